"""The OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions, and
vLLM's /tokenize and /detokenize. Each reads its body (http_io.py) and hands it to
OpenAIServing, which owns what the request means.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from preheat.engine.api.http_io import Bodies, openapi_body, respond
from preheat.engine.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    now,
)
from preheat.engine.api.openai_serving import OpenAIServing

# The model card's `created`: when this server started.
_STARTED = now()


def add_openai_routes(app: FastAPI, serving: OpenAIServing, bodies: Bodies) -> None:
    aengine = serving.aengine

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        card: dict[str, Any] = {"id": serving.model_name, "object": "model", "created": _STARTED,
                                "owned_by": "preheat"}
        if aengine.engine is not None:
            card["max_model_len"] = int(aengine.engine.max_model_len)
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat(request: Request) -> Response:
        req = await bodies.read(request, ChatCompletionRequest)
        return await respond(request, serving.chat(req))

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        req = await bodies.read(request, CompletionRequest)
        return await respond(request, serving.completion(req))

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(request: Request) -> JSONResponse:
        req = await bodies.read(request, TokenizeRequest)
        return JSONResponse(await serving.tokenize(req))

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(request: Request) -> JSONResponse:
        req = await bodies.read(request, DetokenizeRequest)
        return JSONResponse(await serving.detokenize(req))
