"""Who may call what: one ASGI middleware in front of every route, denying by default.

Three kinds of route (docs/security.md):

- open — OPEN_ROUTES: the probes (`/health`, `/ready`, and SGLang's deep probe
  `/health_generate`, open as in SGLang so it can serve as a probe: one token, no client data
  in its answer) and `/metrics` for the kubelet, the operator and Prometheus, and the API's schema (`/openapi.json`, `/docs`: it describes
  the routes, it holds no data);
- peer — `/admin/*` (snapshot export, forced save): only a bearer token equal to the
  service's peer secret (`--peer-secret-file`); never the clients' `--api-key`, because
  the export holds other clients' conversations. Without a peer secret they do not
  exist (404);
- client — everything else, including routes added later (SGLang's `/generate`, ...):
  the `--api-key` when one is set, open when none is.

Checking here rather than in each route means a new route cannot be forgotten.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from preheat.engine.request.api_errors import APIError

if TYPE_CHECKING:
    from preheat.engine.peer.peer_secret import PeerKeys, PeerSecret

OPEN_ROUTES = frozenset({"/health", "/ready", "/health_generate", "/metrics", "/openapi.json", "/docs",
                         "/docs/oauth2-redirect"})
PEER_PREFIX = "/admin"


def route_kind(path: str) -> str:
    """"open", "peer" or "client" for a request path (as Starlette routes it)."""
    if path in OPEN_ROUTES:
        return "open"
    if path == PEER_PREFIX or path.startswith(PEER_PREFIX + "/"):
        return "peer"
    return "client"


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def refusal(kind: str, token: str | None, api_key: str | None, peer_keys: PeerKeys | None) -> APIError | None:
    """None when a request to a route of this kind with this bearer token may pass."""
    if kind == "open":
        return None
    if kind == "peer":
        if peer_keys is None:
            return APIError(404, "Not Found", code="not_found")
        if token is None or not peer_keys.matches(token):
            return APIError(401, "/admin/* needs the service's peer secret "
                            "(`Authorization: Bearer <peer secret>`); the API key does not grant it",
                            code="invalid_peer_secret")
        return None
    if api_key is not None and (token is None or
                                not hmac.compare_digest(token.encode(), api_key.encode())):
        return APIError(401, "Incorrect or missing API key; send `Authorization: Bearer <key>`",
                        code="invalid_api_key")
    return None


class Authentication:
    """`peer_secret`: engine/peer/peer_secret.PeerSecret (its keys are re-read as the Secret
    rotates) or None. `on_refusal(status)` counts refusals."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, peer_secret: PeerSecret | None,
                 on_refusal: Callable[[int], None] = lambda status: None) -> None:
        self.app = app
        self.api_key = api_key
        self.peer_secret = peer_secret
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            keys = self.peer_secret.keys() if self.peer_secret is not None else None
            denied = refusal(route_kind(scope["path"]), bearer_token(scope["headers"]),
                             self.api_key, keys)
            if denied is not None:
                self.on_refusal(denied.status)
                await denied.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
