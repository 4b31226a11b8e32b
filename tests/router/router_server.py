"""A real router (router/app.py under uvicorn) on a free loopback port, in the test's event
loop, so the test can change its endpoint set directly."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import uvicorn
from serve_process import free_port

from preheat.router.app import build_app
from preheat.router.config import RouterConfig
from preheat.router.discovery import ApiAccess, Endpoints


@contextlib.asynccontextmanager
async def running_router(cfg: RouterConfig, access: ApiAccess | None = None,
                         endpoints: Endpoints | None = None) -> AsyncIterator[tuple[str, object]]:
    """Yields (base URL, app); `access` None: no API watch, the test owns `endpoints`."""
    port = free_port()
    app = build_app(cfg, access, endpoints)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
