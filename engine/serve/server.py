"""The HTTP face of the engine: OpenAI-compatible API, SGLang's native routes, /health,
/ready, /metrics, the operator's /admin/* routes, and the API's OpenAPI document
(/openapi.json, browsable at /docs, as vLLM serves them).

`create_app` assembles the FastAPI app around an EngineClient (engine/engine_client.py;
AsyncEngine in production) from its route groups, each in its own module:

    error handlers   engine/serve/error_handlers.py   every error OpenAI-shaped and counted
    probes           engine/serve/probes.py           /health, /ready, /metrics
    OpenAI           engine/api/routes.py             /v1/*, /tokenize, /detokenize
    admin            engine/serve/admin_routes.py     /admin/snapshot (+ the snapshot peer route)
    SGLang           engine/sglang/routes.py          /generate, /server_info, ...
    middleware       connection close while draining, auth, request limit, trusted hosts

Request bodies are read and checked by engine/api/http_io.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from preheat.engine.api.http_io import Bodies
from preheat.engine.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from preheat.engine.api.openai_serving import OpenAIServing
from preheat.engine.api.routes import add_openai_routes
from preheat.engine.engine_client import EngineClient
from preheat.engine.serve.admin_routes import add_admin_routes
from preheat.engine.serve.connection_close import CloseWhileDraining
from preheat.engine.serve.error_handlers import add_error_handlers
from preheat.engine.serve.http_auth import Authentication
from preheat.engine.serve.http_limits import RequestLimit, TrustedHosts
from preheat.engine.serve.probes import add_probe_routes
from preheat.engine.sglang.protocol import GenerateRequest
from preheat.engine.sglang.routes import add_sglang_routes
from preheat.engine.sglang.serving import SGLangServing
from preheat.engine.warm.snapshot_peer import add_snapshot_peer_routes

if TYPE_CHECKING:
    from preheat.engine.peer.peer_secret import PeerSecret
    from preheat.engine.warm.snapshotter import Snapshotter

# The request models /openapi.json describes (each route names its own by reference).
_BODIES: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest, TokenizeRequest,
                                        DetokenizeRequest, GenerateRequest)


def create_app(
    aengine: EngineClient,
    model_name: str | None = None,
    *,
    api_key: str | None = None,
    max_body_bytes: int = 4 * 1024 * 1024,
    snapshotter: Snapshotter | None = None,
    peer_secret: PeerSecret | None = None,
    request_limit: int | None = None,
    trusted_hosts: list[str] | None = None,
    body_timeout: float = 30.0,
) -> FastAPI:
    """`api_key` guards the client API, `peer_secret` (engine/peer/peer_secret.PeerSecret) the
    /admin/* routes (engine/serve/http_auth.py); `request_limit` and `trusted_hosts`:
    engine/serve/http_limits.py; `body_timeout`: seconds to receive a body before 408."""
    app = FastAPI(title="preheat", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    serving = OpenAIServing(aengine, model_name)
    bodies = Bodies(max_body_bytes, body_timeout)
    app.state.aengine = aengine
    app.state.serving = serving

    # Registered in this order, which is also the order of /openapi.json's paths.
    add_error_handlers(app, aengine.metrics)
    add_probe_routes(app, aengine, lambda: serving.model_name)
    add_openai_routes(app, serving, bodies)
    add_admin_routes(app, aengine, snapshotter)
    add_sglang_routes(app, SGLangServing(serving), bodies)
    add_snapshot_peer_routes(app, aengine, snapshotter)
    _add_middleware(app, aengine, api_key, peer_secret, request_limit, trusted_hosts)
    return app


def _add_middleware(app: FastAPI, aengine: EngineClient, api_key: str | None, peer_secret: PeerSecret | None,
                    request_limit: int | None, trusted_hosts: list[str] | None) -> None:
    metrics = aengine.metrics
    app.add_middleware(CloseWhileDraining, aengine=aengine)
    # Added last = outermost: hosts, then the request limit, then who may call what.
    app.add_middleware(Authentication, api_key=api_key, peer_secret=peer_secret,
                       on_refusal=lambda status: metrics.request_errors.labels(status=str(status)).inc())
    if request_limit is not None:
        app.add_middleware(RequestLimit, limit=request_limit)
    if trusted_hosts:
        app.add_middleware(TrustedHosts, hosts=trusted_hosts)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The generated document, with the request models the routes validate by hand."""
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
