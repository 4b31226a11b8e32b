"""HTTP hygiene in front of the engine: how long a client may take to send its request, how
many requests run at once, and which Host names are answered.

- Header deadline (GuardedH11Protocol): uvicorn closes an idle kept-alive connection, but
  a client that sends its request line and headers one byte every few seconds (slowloris)
  holds a connection forever. Here a connection whose next request's headers are not
  complete within `header_timeout` seconds is closed. The body has its own deadline
  (engine/api/http_io.py read_body: 408).
- Concurrency (RequestLimit): at most `limit` requests in flight, beyond which a request is
  answered 503 with Retry-After — but never a probe or /metrics (PROBE_ROUTES): a pod
  under load must still be seen alive and ready, or the kubelet restarts it. The default
  (config) is above max-num-seqs + max-queue-len, so the engine's own 429 stays the
  answer to load and this only bounds what the scheduler never sees.
- Trusted hosts (TrustedHosts): with a list, a request whose Host is not on it is
  refused (DNS rebinding from a browser), probes exempt (the kubelet sends the pod IP).
"""

from __future__ import annotations

import asyncio
import json

from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from preheat.engine.request.api_errors import error_body

PROBE_ROUTES = frozenset({"/health", "/ready", "/metrics"})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers."""

    header_timeout: float = 10.0  # set per server by guarded_protocol()
    _header_timer: asyncio.TimerHandle | None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._header_cycle = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not getattr(self, "_header_cycle", None):
            self._disarm()  # a new request's headers arrived

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._disarm()
            self._arm()  # the next request on this connection gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection: request headers not complete within %ss",
                             self.header_timeout)
            self.transport.close()


def guarded_protocol(header_timeout: float) -> type[GuardedH11Protocol]:
    return type("GuardedH11", (GuardedH11Protocol,), {"header_timeout": header_timeout})


async def _json_error(send: Send, status: int, message: str, code: str,
                      headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class RequestLimit:
    """At most `limit` non-probe requests at once; the rest get 503 + Retry-After."""

    def __init__(self, app: ASGIApp, *, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0
        self.refused = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_ROUTES:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            self.refused += 1
            await _json_error(send, 503, f"more than {self.limit} requests at once; retry shortly",
                              "too_many_connections", ((b"retry-after", b"1"),))
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class TrustedHosts:
    """Starlette's TrustedHostMiddleware for every route but the probes."""

    def __init__(self, app: ASGIApp, *, hosts: list[str]) -> None:
        self.app = app
        self.checked = TrustedHostMiddleware(app, allowed_hosts=hosts, www_redirect=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in PROBE_ROUTES:
            await self.app(scope, receive, send)
        else:
            await self.checked(scope, receive, send)
