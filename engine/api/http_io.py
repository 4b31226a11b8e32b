"""Request bodies in, responses out, for every JSON route (the OpenAI ones here, SGLang's in
engine/sglang/routes.py).

The routes read and check bodies themselves (size, UTF-8, JSON, schema) so every refusal is
an OpenAI-shaped error; each route still declares its request model (`openapi_body`), so
/openapi.json carries the real schemas. A body larger than PARSE_INLINE_BYTES is parsed and
validated in a worker thread: nothing a client sends may hold the event loop, which also
answers the probes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from preheat.engine.request.api_errors import APIError, from_validation_error

# Bodies up to this size are parsed on the event loop (well under a millisecond); larger
# ones, up to --max-request-body-bytes, in a worker thread.
PARSE_INLINE_BYTES = 64 * 1024

M = TypeVar("M", bound=BaseModel)

# What serving a request gives back: a JSON body (a list: SGLang's /generate answering a
# batch), or the events of a stream.
Answer = dict[str, Any] | list[dict[str, Any]] | AsyncIterator[str]


@dataclass(frozen=True)
class Bodies:
    """How this server reads request bodies: at most `max_bytes`
    (--max-request-body-bytes), received within `timeout` seconds."""

    max_bytes: int
    timeout: float = 30.0

    async def read(self, request: Request, model: type[M]) -> M:
        return await read_request(request, model, self.max_bytes, self.timeout)


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """The route's OpenAPI requestBody: the pydantic model it validates with."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


async def read_request(request: Request, model: type[M], limit: int, timeout: float = 30.0) -> M:
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


def parse_json(body: bytes) -> dict[str, Any]:
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


def _validate(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def respond(request: Request, work: Awaitable[Answer]) -> Response:
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
