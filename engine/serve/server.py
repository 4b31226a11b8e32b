"""The HTTP face of the engine: OpenAI-compatible API, /health, /ready, /metrics, and the
API's OpenAPI document (/openapi.json, browsable at /docs, as vLLM serves them).

`create_app` builds the FastAPI app around an AsyncEngine. It reads and checks request
bodies itself (size, UTF-8, JSON, schema) so every refusal is an OpenAI-shaped error; each
route still declares its request model, so /openapi.json carries the real schemas (ranges
and list lengths included). A body larger than PARSE_INLINE_BYTES is parsed and validated
in a worker thread: nothing a client sends may hold the event loop, which also answers the
probes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from preheat.engine.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    now,
)
from preheat.engine.api.openai_serving import OpenAIServing
from preheat.engine.async_engine import AsyncEngine
from preheat.engine.request.api_errors import APIError, error_body, from_validation_error
from preheat.engine.serve.connection_close import CloseWhileDraining
from preheat.engine.serve.http_auth import Authentication
from preheat.engine.serve.http_limits import RequestLimit, TrustedHosts
from preheat.engine.sglang.protocol import GenerateRequest
from preheat.engine.sglang.routes import add_sglang_routes
from preheat.engine.sglang.serving import SGLangServing
from preheat.engine.warm.snapshot_peer import add_snapshot_peer_routes

log = logging.getLogger(__name__)

_STARTED = now()

# Bodies up to this size are parsed on the event loop (well under a millisecond); larger
# ones, up to --max-request-body-bytes, in a worker thread.
PARSE_INLINE_BYTES = 64 * 1024


def _body(model: type) -> dict[str, Any]:
    """The route's OpenAPI requestBody: the pydantic model it validates with."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


_BODIES = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, GenerateRequest)


def create_app(
    aengine: AsyncEngine,
    model_name: str | None = None,
    *,
    api_key: str | None = None,
    max_body_bytes: int = 4 * 1024 * 1024,
    snapshotter: Any = None,
    peer_secret: Any = None,
    request_limit: int | None = None,
    trusted_hosts: list[str] | None = None,
    body_timeout: float = 30.0,
) -> FastAPI:
    """`api_key` guards the client API, `peer_secret` (engine/peer/peer_secret.PeerSecret) the
    /admin/* routes (engine/serve/http_auth.py); `request_limit` and `trusted_hosts`:
    engine/serve/http_limits.py; `body_timeout`: seconds to receive a body before 408."""
    app = FastAPI(title="preheat", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    serving = OpenAIServing(aengine, model_name)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title="Preheat", version="1", description="OpenAI-compatible API",
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in _BODIES:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    metrics = aengine.metrics
    app.state.aengine = aengine
    app.state.serving = serving

    # ------------------------------------------------------------ errors

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        metrics.request_errors.labels(status=str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.request_errors.labels(status=str(exc.status_code)).inc()
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        metrics.request_errors.labels(status="500").inc()
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)

    # ------------------------------------------------------------ probes

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
        body: dict[str, Any] = {"phase": aengine.phase, "model": serving.model_name,
                                "in_flight": aengine.num_in_flight,
                                "startup_steps": dict(aengine.startup_steps)}
        if aengine.phase_detail is not None:  # e.g. downloading: bytes_done, bytes_total
            body.update(aengine.phase_detail())
        return JSONResponse(body, status_code=200 if aengine.is_ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    # ------------------------------------------------------------ API

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        card: dict[str, Any] = {"id": serving.model_name, "object": "model", "created": _STARTED,
                                "owned_by": "preheat"}
        if aengine.engine is not None:
            card["max_model_len"] = int(aengine.engine.max_model_len)
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions", openapi_extra=_body(ChatCompletionRequest))
    async def chat(request: Request) -> Response:
        req = await read_request(request, ChatCompletionRequest, max_body_bytes, body_timeout)
        return await _respond(request, serving.chat(req))

    @app.post("/v1/completions", openapi_extra=_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        req = await read_request(request, CompletionRequest, max_body_bytes, body_timeout)
        return await _respond(request, serving.completion(req))

    @app.post("/tokenize", openapi_extra=_body(TokenizeRequest))
    async def tokenize(request: Request) -> JSONResponse:
        req = await read_request(request, TokenizeRequest, max_body_bytes, body_timeout)
        return JSONResponse(await serving.tokenize(req))

    @app.post("/detokenize", openapi_extra=_body(DetokenizeRequest))
    async def detokenize(request: Request) -> JSONResponse:
        req = await read_request(request, DetokenizeRequest, max_body_bytes, body_timeout)
        return JSONResponse(await serving.detokenize(req))

    @app.post("/admin/snapshot")
    async def snapshot(request: Request) -> JSONResponse:
        """Saves a hot-prefix snapshot now (e.g. before a planned rollout). One at a time:
        409 while a save (this route's, the periodic one or the shutdown one) runs; 429
        within MIN_SAVE_INTERVAL_S of the last one saved on request."""
        if snapshotter is None:
            raise APIError(404, "snapshots are off: start the server with --snapshot-dir",
                           code="snapshots_disabled")
        if aengine.engine is None or aengine.error is not None:
            raise APIError(503, f"engine is not serving (phase: {aengine.phase})", code="not_ready")
        from preheat.engine.warm.snapshot_peer import MIN_SAVE_INTERVAL_S
        from preheat.engine.warm.snapshotter import SnapshotInProgress, SnapshotTooSoon

        try:
            saved = await asyncio.to_thread(snapshotter.save_forced, aengine, MIN_SAVE_INTERVAL_S)
        except SnapshotInProgress:
            raise APIError(409, "a snapshot is already being saved; wait for it to finish",
                           code="snapshot_in_progress") from None
        except SnapshotTooSoon as e:
            raise APIError(429, str(e), code="snapshot_too_soon", retry_after=e.retry_after) from None
        except Exception as e:
            log.error("snapshot on request failed: %s: %s", type(e).__name__, e)
            raise APIError(500, f"snapshot failed: {type(e).__name__}", code="snapshot_failed") from None
        return JSONResponse({"path": saved.path, "tokens": saved.tokens,
                             "prefixes": saved.prefixes, "seconds": round(saved.seconds, 3)})

    add_sglang_routes(app, SGLangServing(serving), read_request, _respond, max_body_bytes, body_timeout,
                      _body(GenerateRequest))
    add_snapshot_peer_routes(app, aengine, snapshotter)
    app.add_middleware(CloseWhileDraining, aengine=aengine)
    # Added last = outermost: hosts, then the request limit, then who may call what.
    app.add_middleware(Authentication, api_key=api_key, peer_secret=peer_secret,
                       on_refusal=lambda status: metrics.request_errors.labels(status=str(status)).inc())
    if request_limit is not None:
        app.add_middleware(RequestLimit, limit=request_limit)
    if trusted_hosts:
        app.add_middleware(TrustedHosts, hosts=trusted_hosts)
    return app


async def read_request(request: Request, model: type, limit: int, timeout: float = 30.0) -> Any:
    """The body validated as `model`; a large body is parsed and validated off the loop."""
    body = await read_body(request, limit, timeout)
    if len(body) <= PARSE_INLINE_BYTES:
        return _validate(model, parse_json(body))
    return await asyncio.to_thread(lambda: _validate(model, parse_json(body)))


def check_json_content_type(request: Request) -> None:
    """415 unless the body is declared `application/json` (parameters such as charset
    allowed). A browser can send a form or text/plain to any address without asking
    (CSRF, DNS rebinding); application/json needs a CORS preflight, which this server never
    grants. The OpenAI SDKs and SGLang's frontend send application/json."""
    declared = request.headers.get("content-type", "")
    if declared.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(415, f"request body must be sent as Content-Type: application/json, "
                       f"not {declared or 'none'!r}", code="unsupported_media_type")


async def read_body(request: Request, limit: int, timeout: float = 30.0) -> bytes:
    """The raw JSON body, refusing another content type (415), one larger than `limit`
    before reading it all (413), and one that takes longer than `timeout` seconds to
    arrive (408: a client trickling its body holds a connection and a request slot)."""
    check_json_content_type(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                       code="body_too_large")
    body = bytearray()

    async def collect() -> None:
        async for chunk in request.stream():  # also bounds chunked bodies without a length
            body.extend(chunk)
            if len(body) > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes",
                               code="body_too_large")

    try:
        await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"request body not received within {timeout:g}s",
                       code="body_timeout") from None
    return bytes(body)


def parse_json(body: bytes) -> dict:
    """The body as a JSON object, refusing non-UTF-8 and malformed bodies."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})",
                       code="invalid_encoding") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} "
                       f"column {e.colno}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply",
                       code="invalid_json") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return data


def _validate(model: type, data: dict) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def _respond(request: Request, work: Any) -> Response:
    """Runs a request; for a non-streamed one, a client hang-up cancels it (and so aborts its
    engine requests). A stream is cancelled by Starlette itself when the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            return Response(status_code=499)  # nobody is listening any more
    finally:
        watcher.cancel()
    result = task.result()
    if isinstance(result, (dict, list)):  # a list: SGLang's /generate answering a batch
        return JSONResponse(result)
    return StreamingResponse(_closing(result), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _closing(gen: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for item in gen:
            yield item
    finally:
        await gen.aclose()  # type: ignore[attr-defined]


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
