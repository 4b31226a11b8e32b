"""The routes Kubernetes and Prometheus call: /health (liveness), /ready (readiness, with
the phase and what the start-up did) and /metrics. They read state only and never wait on
the engine, so they answer while the model loads and whatever requests are in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from preheat.engine.engine_client import EngineClient


def add_probe_routes(app: FastAPI, aengine: EngineClient, model_name: Callable[[], str]) -> None:
    """`model_name()`: the served model's name as /ready reports it."""
    metrics = aengine.metrics

    @app.get("/health")
    async def health() -> JSONResponse:
        # Alive means the step loop still runs: a dead loop can only be cured by a restart.
        if aengine.error is not None:
            # The exception's own text may hold request data or paths: it is in the log only.
            return JSONResponse({"status": "dead", "error": "the engine's step loop stopped "
                                 f"({type(aengine.error).__name__}); see the log"}, status_code=503)
        return JSONResponse({"status": "ok", "phase": aengine.phase})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        body: dict[str, Any] = {"phase": aengine.phase, "model": model_name(),
                                "in_flight": aengine.num_in_flight,
                                "startup_steps": dict(aengine.startup_steps)}
        if aengine.phase_detail is not None:  # e.g. downloading: bytes_done, bytes_total
            body.update(aengine.phase_detail())
        return JSONResponse(body, status_code=200 if aengine.is_ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)
