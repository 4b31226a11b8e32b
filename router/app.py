"""The router's HTTP app: its own /health, /ready, /metrics; everything else is proxied
(router/proxy.py), /admin/* refused. The pod watch runs for the app's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from preheat.router.config import RouterConfig
from preheat.router.discovery import ApiAccess, Endpoints, watch_engines
from preheat.router.metrics import RouterMetrics
from preheat.router.proxy import Proxy

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


def build_app(cfg: RouterConfig, access: ApiAccess | None,
              endpoints: Endpoints | None = None) -> Starlette:
    """access None: no watch (a test sets `endpoints` itself)."""
    endpoints = endpoints if endpoints is not None else Endpoints()
    metrics = RouterMetrics()
    proxy = Proxy.create(cfg, endpoints, metrics)

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(_: Request) -> Response:
        # Ready once the pod list has been read: with no engine Ready yet, requests wait for
        # one (up to the retry deadline) rather than the Service dropping the router.
        body = {"synced": endpoints.synced, "engines": sorted(endpoints.ready)}
        return JSONResponse(body, status_code=200 if endpoints.synced else 503)

    async def metrics_route(_: Request) -> Response:
        proxy._load()  # refresh the engine count
        data, ctype = metrics.render()
        return Response(data, media_type=ctype)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(watch_engines(cfg, endpoints, access)) if access else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await proxy.client.aclose()

    app = Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/{path:path}", proxy.handle, methods=METHODS),
    ], lifespan=lifespan)
    app.state.proxy = proxy
    app.state.endpoints = endpoints
    return app
