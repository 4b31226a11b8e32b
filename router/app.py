"""The router's HTTP app: its own /health, /ready, /metrics and the peers' /router/placements;
everything else is proxied (router/proxy.py), /admin/* refused. The pod watch and the pulls
of the peers' placements run for the app's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from preheat.router.config import RouterConfig
from preheat.router.discovery import ApiAccess, Endpoints, watch_engines
from preheat.router.metrics import RouterMetrics
from preheat.router.peers import PATH, journal_body, share_placements
from preheat.router.proxy import Proxy, error

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


def build_app(cfg: RouterConfig, access: ApiAccess | None,
              endpoints: Endpoints | None = None) -> Starlette:
    """access None: no watch (a test sets `endpoints`, peers included, itself)."""
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
        proxy.refresh()  # the engine and placement counts
        data, ctype = metrics.render()
        return Response(data, media_type=ctype)

    async def placements(request: Request) -> Response:
        # Peers only: a client of the Service must not learn which conversations are live.
        if request.client is None or request.client.host not in endpoints.peer_hosts():
            return error(403, f"{PATH} answers the service's other router pods only", "forbidden")
        try:
            after = int(request.query_params.get("after", "0"))
        except ValueError:
            return error(400, "after: an integer", "invalid_request_error")
        return JSONResponse(journal_body(proxy.ledger.placements, after,
                                         request.query_params.get("epoch", ""), time.monotonic()))

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(watch_engines(cfg, endpoints, access))] if access else []
        peer_client = None
        if cfg.share_interval > 0:
            # From the pod IP: that is what the peers check (a loopback source address would
            # not be a router's, on the local harness nor behind some CNIs).
            transport = httpx.AsyncHTTPTransport(local_address=cfg.pod_ip) if cfg.pod_ip else None
            peer_client = httpx.AsyncClient(trust_env=False, transport=transport,
                                            timeout=httpx.Timeout(2.0, connect=cfg.connect_timeout))
            tasks.append(asyncio.create_task(share_placements(
                proxy.ledger.placements, endpoints, metrics, cfg.share_interval, peer_client)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if peer_client is not None:
                await peer_client.aclose()
            await proxy.client.aclose()

    app = Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route(PATH, placements, methods=["GET"]),
        Route("/{path:path}", proxy.handle, methods=METHODS),
    ], lifespan=lifespan)
    app.state.proxy = proxy
    app.state.endpoints = endpoints
    return app
