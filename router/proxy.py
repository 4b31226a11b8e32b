"""The proxy shell around policy.choose(): one request in, one engine attempt at a time.

The response headers are held until the engine's first body chunk has arrived, so an
attempt that fails before any byte could reach the client — connection refused or reset,
a 503 from a draining engine, a pod gone — is retried on another Ready pod, within
`retry_deadline` and `max_attempts`. From the first chunk on the response streams through
unbuffered, and an engine that breaks off aborts the client's connection (never a clean
but truncated answer). With no Ready pod left, a request waits for the endpoint set to
change, up to the deadline: a failover's promoted pod then serves it.

Nothing is queued here: every request is forwarded as it arrives, so the engines' own
queues (`vllm:num_requests_waiting`) stay the autoscaler's signal.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from preheat.router.config import RouterConfig
from preheat.router.discovery import Endpoints
from preheat.router.metrics import RouterMetrics
from preheat.router.placement import Ledger
from preheat.router.policy import Balance
from preheat.router.prefix import SeenKeys, request_key

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the HTTP layer recomputes.
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "transfer-encoding", "upgrade", "host", "content-length"}


ENGINE_HEADER = "x-preheat-engine"


def error(status: int, message: str, kind: str = "router_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)


class _Retry(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass
class Proxy:
    cfg: RouterConfig
    endpoints: Endpoints
    metrics: RouterMetrics
    client: httpx.AsyncClient
    ledger: Ledger
    seen: SeenKeys = field(default_factory=SeenKeys)

    @classmethod
    def create(cls, cfg: RouterConfig, endpoints: Endpoints, metrics: RouterMetrics) -> Proxy:
        client = httpx.AsyncClient(
            trust_env=False,  # a proxy set for the API server must not sit between us and pods
            timeout=httpx.Timeout(cfg.read_timeout, connect=cfg.connect_timeout, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        return cls(cfg, endpoints, metrics, client, Ledger(cfg.affinity_window))

    def refresh(self) -> dict[str, str]:
        """The Ready pods; forgets the ones gone (no series left behind for them)."""
        ready = self.endpoints.ready
        self.metrics.engines.set(len(ready))
        for gone in self.ledger.prune(ready):
            self.seen.forget(gone)
            self.metrics.in_flight.remove(gone)
        self.metrics.placements.set(len(self.ledger.placements))
        return ready

    def _track(self, pod: str, key: str | None, delta: int) -> None:
        now = time.monotonic()
        n = (self.ledger.start if delta > 0 else self.ledger.finish)(pod, key, now)
        self.metrics.in_flight.labels(pod=pod).set(n)

    async def handle(self, request: Request) -> Response:
        if request.url.path.startswith("/admin"):
            # Peer-only routes (snapshot export, forced save): never through the router.
            return error(404, "/admin/* is not served through the router", "not_found")
        body = await request.body()
        key = None
        if body and request.method == "POST":
            try:
                key = request_key(json.loads(body), self.cfg.affinity_chars)
            except (ValueError, UnicodeDecodeError):
                key = None  # the engine answers bad JSON with its own 4xx
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        deadline = time.monotonic() + self.cfg.retry_deadline
        tried: set[str] = set()
        attempts, last = 0, "no Ready engine pod"
        balance = Balance(self.cfg.balance_factor, self.cfg.balance_slack)
        while attempts < self.cfg.max_attempts:
            choice = self.ledger.choose(self.refresh(), key, balance, time.monotonic(),
                                        exclude=tried)
            if choice is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # Nothing untried is Ready: wait for the endpoints to change (a pod leaves,
                # a promoted one arrives), then the pods still there may be tried again.
                await self.endpoints.wait_change(min(left, 1.0))
                tried.clear()  # a pod seen failing that is still Ready gets one more try
                continue
            attempts += 1
            if attempts == 1:
                self.metrics.routed.labels(reason=choice.reason).inc()
                if key is not None:
                    held = self.seen.holds(choice.pod, key)
                    self.metrics.prefix_held.labels(held="true" if held else "false").inc()
            try:
                return await self._attempt(choice.pod, request.method, path, headers, body, key)
            except _Retry as e:
                tried.add(choice.pod)
                last = f"{choice.pod}: {e}"
                self.metrics.retries.labels(pod=choice.pod, reason=e.reason).inc()
                log.info("attempt %d on %s failed before any byte (%s): %s", attempts,
                         choice.pod, e.reason, e)
                if time.monotonic() >= deadline:
                    break
        self.metrics.unroutable.inc()
        return error(503, f"no engine could serve the request after {attempts} attempt(s): "
                     f"{last}", "unavailable")

    async def _attempt(self, pod: str, method: str, path: str, headers: list[tuple[str, str]],
                       body: bytes, key: str | None) -> Response:
        url = self.endpoints.ready.get(pod)
        if url is None:
            raise _Retry("gone", "left the endpoints")
        self._track(pod, key, +1)
        resp: httpx.Response | None = None
        try:
            req = self.client.build_request(method, url + path, headers=headers, content=body)
            resp = await self.client.send(req, stream=True)
            if resp.status_code == 503:
                raise _Retry("unavailable", "503 (draining or not ready)")
            chunks = resp.aiter_raw()
            first = b""
            async for first in chunks:
                if first:
                    break
        except _Retry:
            await self._close(resp, pod, key)
            raise
        except httpx.TransportError as e:
            await self._close(resp, pod, key)
            reason = "connect" if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)) else "reset"
            raise _Retry(reason, f"{type(e).__name__}: {e}") from e
        except BaseException:
            await self._close(resp, pod, key)
            raise
        if key is not None:
            self.seen.add(pod, key)
        outcome = f"{resp.status_code // 100}xx"
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
        out_headers[ENGINE_HEADER] = pod  # which engine answered (debugging, benchmarks)
        return StreamingResponse(self._rest(resp, pod, key, first, chunks, outcome),
                                 status_code=resp.status_code, headers=out_headers)

    async def _rest(self, resp: httpx.Response, pod: str, key: str | None, first: bytes,
                    chunks: AsyncIterator[bytes], outcome: str) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError as e:
            outcome = "aborted"
            log.warning("engine %s broke off a response after bytes were sent: %s", pod, e)
            raise  # the client's connection is aborted: a truncated answer must not look whole
        finally:
            self.metrics.attempts.labels(pod=pod, outcome=outcome).inc()
            await resp.aclose()
            self._track(pod, key, -1)

    async def _close(self, resp: httpx.Response | None, pod: str, key: str | None) -> None:
        if resp is not None:
            await resp.aclose()
        self._track(pod, key, -1)
        self.metrics.attempts.labels(pod=pod, outcome="no_bytes").inc()
