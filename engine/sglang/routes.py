"""SGLang's native routes on the same app as the OpenAI ones (same auth, body limits,
backpressure and metrics): `/generate`, `/get_model_info` (and `/model_info`),
`/server_info` (and `/get_server_info`), `/flush_cache`, `/health_generate`.

These are what SGLang's frontend language (`sglang.RuntimeEndpoint`) calls; the answers
carry the fields it and SGLang's docs name (see docs/coming-from-sglang.md).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from preheat.engine.api.http_io import Bodies, openapi_body, respond
from preheat.engine.engine_client import ServedEngine
from preheat.engine.request.api_errors import APIError
from preheat.engine.sglang.protocol import GenerateRequest
from preheat.engine.sglang.serving import SGLangServing

log = logging.getLogger(__name__)

# Settings /server_info never shows.
_SECRET_SETTINGS = {"api_key", "peer_secret_file"}


def add_sglang_routes(app: FastAPI, serving: SGLangServing, bodies: Bodies) -> None:
    """Who may call these is decided by engine/serve/http_auth.py's middleware, as for every route."""
    aengine = serving.aengine

    @app.post("/generate", openapi_extra=openapi_body(GenerateRequest))
    @app.put("/generate", include_in_schema=False)
    async def generate(request: Request) -> Response:
        req = await bodies.read(request, GenerateRequest)
        return await respond(request, serving.generate(req))

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info(request: Request) -> JSONResponse:
        engine = serving.openai.ready_engine()
        return JSONResponse(model_info_body(engine, serving.openai.model_name))

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info(request: Request) -> JSONResponse:
        engine = serving.openai.ready_engine()
        return JSONResponse(server_info_body(engine, aengine.phase))

    @app.post("/flush_cache")
    @app.get("/flush_cache", include_in_schema=False)
    async def flush_cache(request: Request) -> Response:
        """As SGLang: refused (400) while requests run or wait, since their prefixes are in use."""
        engine = serving.openai.ready_engine()
        if aengine.num_in_flight:
            return PlainTextResponse(
                f"Cache not flushed: {aengine.num_in_flight} request(s) are running or waiting.\n",
                status_code=400)
        dropped = await aengine.run_in_engine(flush, engine)
        log.info("flush_cache: dropped %d cached tokens", dropped)
        return PlainTextResponse(f"Cache flushed: {dropped} cached tokens dropped.\n")

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Healthy when the engine generates one token now (SGLang's deep health check;
        like SGLang's, it needs no API key: an open route in engine/serve/http_auth.py). /health stays the cheap liveness probe."""
        try:
            await serving.generate(GenerateRequest.model_validate(
                {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}))
        except APIError as e:
            if e.status == 429:  # the line is full: the engine is busy serving, not broken
                return JSONResponse({"status": "busy"}, status_code=200)
            return JSONResponse({"status": "unhealthy", "error": e.message}, status_code=503)
        return Response(status_code=200)


def model_info_body(engine: ServedEngine, served_name: str) -> dict[str, Any]:
    hf = getattr(engine, "hf_config", None)
    return {
        "model_path": engine.config.model or served_name,
        "tokenizer_path": engine.config.model or served_name,
        "served_model_name": served_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(hf, "model_type", None),
        "architectures": getattr(hf, "architectures", None),
        "max_model_len": int(engine.max_model_len),
    }


def server_info_body(engine: ServedEngine, phase: str) -> dict[str, Any]:
    """Preheat's settings (under their own names), SGLang's names for the ones its users read
    first, and live scheduler state under `internal_states`, as SGLang nests it."""
    from preheat import __version__

    settings = {k: v for k, v in dataclasses.asdict(engine.config).items() if k not in _SECRET_SETTINGS}
    stats = engine.stats()
    state = {k: v for k, v in dataclasses.asdict(stats).items() if isinstance(v, (int, float, str, bool))} \
        if dataclasses.is_dataclass(stats) and not isinstance(stats, type) else {}
    return {
        **settings,
        "model_path": engine.config.model,
        "context_length": int(engine.max_model_len),
        "max_running_requests": engine.config.max_num_seqs,
        "tp_size": engine.config.tensor_parallel_size,
        "max_total_num_tokens": int(engine.pool.capacity_pages * engine.pool.page_size),
        "phase": phase,
        "internal_states": [state],
        "version": __version__,
        "frontend": "preheat",
    }


def flush(engine: ServedEngine) -> int:
    """On the step thread: drops every cached prefix nobody holds from the device pool (L1),
    without offloading it to L2/L3 on the way out. Prefixes pinned by warmup templates stay:
    they are what makes this pod warm. Copies already in L2/L3 stay too (see
    docs/coming-from-sglang.md). Returns the tokens dropped."""
    kv = engine.kv
    radix = kv.radix
    if radix is None:
        return 0
    before = radix.total_pages
    hook, radix.on_evict = radix.on_evict, None
    try:
        radix.reset()
    finally:
        radix.on_evict = hook
    return (before - radix.total_pages) * engine.pool.page_size
