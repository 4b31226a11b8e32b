"""`preheat serve`: parse the settings, start uvicorn at once (so /health and /ready answer
while the model loads), load and warm the engine, serve; on SIGTERM drain and exit 0."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from typing import TYPE_CHECKING

from preheat.engine.config import ConfigError, EngineConfig, add_arguments, from_namespace

if TYPE_CHECKING:
    from preheat.engine.metrics import Metrics
    from preheat.engine.warm.warm_start import WarmStart

# The server stack (uvicorn, FastAPI, torch via the engine) is imported inside serve(), so
# `--help` and a bad flag answer at once.

log = logging.getLogger(__name__)


def warm_start(config: EngineConfig, metrics: Metrics) -> WarmStart:
    """Steps run after loading and before ready (snapshot restore in phase "restoring" when
    --snapshot-dir is set, then the warmup templates in phase "warming" when
    --warmup-templates is set) and the shutdown callbacks (save the snapshot). Raises
    TemplateError for an invalid template directory, before anything loads."""
    from preheat.engine.warm.warm_start import build_warm_start

    return build_warm_start(config, metrics)


async def serve(config: EngineConfig, warm: WarmStart | None = None) -> int:
    import uvicorn

    from preheat.engine.async_engine import AsyncEngine
    from preheat.engine.lifecycle import Lifecycle
    from preheat.engine.metrics import default_metrics
    from preheat.engine.serve.draining_server import DrainingServer
    from preheat.engine.serve.http_limits import guarded_protocol
    from preheat.engine.serve.server import create_app

    metrics = default_metrics()
    warm = warm if warm is not None else warm_start(config, metrics)
    aengine = AsyncEngine(metrics)
    aengine.on_shutdown.extend(warm.shutdown_callbacks())
    lifecycle = Lifecycle(config, aengine, warm.steps())
    from preheat.engine.model.uri import parse_model, served_name

    app = create_app(
        aengine,
        # A hub or S3 model has its name before it is downloaded: /ready says it meanwhile.
        config.served_model_name or served_name(parse_model(config.model)),
        api_key=config.api_key,
        max_body_bytes=config.max_request_body_bytes,
        snapshotter=warm.snapshotter,
        peer_secret=warm.peer_secret,
        request_limit=config.request_limit,
        trusted_hosts=config.trusted_host_list,
        body_timeout=config.http_body_timeout,
    )
    from preheat.engine.model.fetch import download_root
    from preheat.engine.model.peer_serve import add_model_peer_routes

    # The --model as given: the lifecycle replaces it by the local path once downloaded.
    add_model_peer_routes(app, config.model, download_root(config.download_dir, config.weight_cache_dir))
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.log_level == "debug",
        timeout_graceful_shutdown=5,
        lifespan="off",
        http=guarded_protocol(config.http_header_timeout),
        timeout_keep_alive=5,  # h11 keeps its own 16 KiB cap on a request's line and headers
    )
    server = DrainingServer(uv_config, lifecycle)

    async def start_engine() -> None:
        if not await lifecycle.start() and server.draining is None:
            server.exit_code = 1  # could not load or warm: let the pod restart us
            server.should_exit = True

    log.info("listening on http://%s:%d", config.host, config.port)
    starting = asyncio.create_task(start_engine())
    await server.serve()
    abandoned = not starting.done()
    if abandoned:
        starting.cancel()
    if server.draining is None:
        aengine.stop()
    if abandoned or aengine.stepping:
        exit_now(server.exit_code, "during start-up" if abandoned else "with an engine step still running")
    return server.exit_code


def exit_now(code: int, why: str) -> None:
    """Exit while a start-up thread (loading the model, fetching a snapshot) or the step
    thread (a step longer than AsyncEngine.stop waits, after a drain that hit its deadline)
    still runs: it is a daemon thread, so nothing waits for it, but finalizing the
    interpreter under a thread inside torch aborts the process (exit 134, not 0;
    engine/idle_priority.py). Nothing is left to clean up: the server has stopped, the
    shutdown callbacks (a snapshot) have run or, during start-up, have nothing to write."""
    log.info("exiting %s", why)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


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
    from preheat.engine.metrics import default_metrics
    from preheat.engine.model.families import UnsupportedModelError
    from preheat.engine.model.preflight import check_supported
    from preheat.engine.peer.peer_secret import PeerSecretError
    from preheat.engine.warm.warmup_templates import TemplateError

    if not config.model:  # the embedded default: say now if its package is missing
        from preheat.engine.model.locations import default_model_path

        try:
            default_model_path()
        except FileNotFoundError as e:
            print(f"preheat serve: error: {e}", file=sys.stderr)
            return 2
    try:
        check_supported(config.model)  # config.json or the GGUF header only: milliseconds
    except UnsupportedModelError as e:  # say so now, not after the server is up
        print(f"preheat serve: error: --model {config.model}: {e}", file=sys.stderr)
        return 2
    try:
        warm = warm_start(config, default_metrics())
    except TemplateError as e:  # an operator's config error: say so now, before loading
        print(f"preheat serve: error: --warmup-templates {config.warmup_templates}: {e}",
              file=sys.stderr)
        return 2
    except PeerSecretError as e:
        print(f"preheat serve: error: --peer-secret-file: {e}", file=sys.stderr)
        return 2
    from preheat.engine.serve.early_start import start_early

    start_early(warm)  # the grammar forkserver, beside the server's start and the load
    try:
        return asyncio.run(serve(config, warm))
    except KeyboardInterrupt:
        return 130
