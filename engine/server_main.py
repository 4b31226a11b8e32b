"""`preheat serve`: parse the settings, start uvicorn at once (so /health and /ready answer
while the model loads), load and warm the engine, serve; on SIGTERM drain and exit 0."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import TYPE_CHECKING, Any

from .config import ConfigError, EngineConfig, add_arguments, from_namespace

if TYPE_CHECKING:
    from .lifecycle import StartupStep

# The server stack (uvicorn, FastAPI, torch via the engine) is imported inside serve(), so
# `--help` and a bad flag answer at once.

log = logging.getLogger("preheat.serve")


def warm_start_steps(config: EngineConfig) -> list["StartupStep"]:
    """Steps run after loading and before ready. The warm-start work registers here:
    snapshot restore (phase "restoring") when --snapshot-dir is set, then the warmup
    templates (phase "warming") when --warmup-templates is set."""
    return []


def shutdown_callbacks(config: EngineConfig) -> list[Any]:
    """Run after draining, before exit: e.g. persist the hot-prefix snapshot."""
    return []


async def serve(config: EngineConfig) -> int:
    import uvicorn

    from .async_engine import AsyncEngine
    from .draining_server import DrainingServer
    from .lifecycle import Lifecycle
    from .metrics import default_metrics
    from .server import create_app

    metrics = default_metrics()
    aengine = AsyncEngine(metrics)
    aengine.on_shutdown.extend(shutdown_callbacks(config))
    lifecycle = Lifecycle(config, aengine, warm_start_steps(config))
    app = create_app(
        aengine,
        config.served_model_name,
        api_key=config.api_key,
        max_body_bytes=config.max_request_body_bytes,
    )
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.log_level == "debug",
        timeout_graceful_shutdown=5,
        lifespan="off",
    )
    server = DrainingServer(uv_config, lifecycle)

    async def start_engine() -> None:
        if not await lifecycle.start() and server.draining is None:
            server.exit_code = 1  # could not load or warm: let the pod restart us
            server.should_exit = True

    log.info("listening on http://%s:%d", config.host, config.port)
    starting = asyncio.create_task(start_engine())
    await server.serve()
    if not starting.done():
        starting.cancel()
    if server.draining is None:
        aengine.stop()
    return server.exit_code


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="preheat serve",
        description="Serve a language model with an OpenAI-compatible API. Every flag can "
        "also be set by its PREHEAT_<FLAG> environment variable; a flag wins.",
    )
    add_arguments(parser)
    ns = parser.parse_args(argv)  # unknown flags: argparse prints usage and exits 2
    try:
        config = from_namespace(ns)
    except ConfigError as e:
        print(f"preheat serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return asyncio.run(serve(config))
    except KeyboardInterrupt:
        return 130
