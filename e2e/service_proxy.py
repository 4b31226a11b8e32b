"""Service stand-ins (TEST HARNESS, not a Preheat component): what a Service, its
EndpointSlices and kube-proxy do for traffic, on this machine.

Each Service of the namespace gets a TCP proxy on 127.0.0.1. Like kube-proxy it works per
connection (layer 4): a new connection goes to one of the Service's ready endpoints (round
robin), and stays there for its life — a kept-alive client connection keeps reaching the
same pod, also after that pod left the endpoints. The endpoints follow the pods the
Service's selector matches (for Preheat: `role=serving`) whose `Ready` condition is True
and that are not being deleted, as the EndpointSlice controller computes them; changes
take effect `propagation_s` later (kube-proxy's lag), and so does a change of the Service's
selector (the operator switches `<name>` from the serving pods to the router pods once one
is Ready): the stand-in watches the Service too. With no ready endpoint a connection
is closed at once (kube-proxy rejects it). A pod is reached at the loopback port the local
kubelet gave it.

ClusterServices also answers the kubelet's cluster-DNS lookups: `http://<service>:<port>`
in a pod's env becomes this proxy's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from e2e.watch import watch

log = logging.getLogger("e2e.service")


def _ready(pod: dict[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _matches(pod: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@dataclass
class ProxyStats:
    connections: dict[str, int] = field(default_factory=dict)  # per backend pod
    refused: int = 0  # no ready endpoint, or the backend refused


class ServiceProxy:
    def __init__(self, client: httpx.AsyncClient, namespace: str, service: str,
                 address_of: Callable[[str], tuple[str, int] | None],
                 propagation_s: float = 0.5) -> None:
        self.client = client
        self.namespace = namespace
        self.service = service
        self.address_of = address_of
        self.propagation_s = propagation_s
        self.selector: dict[str, str] | None = None
        self.endpoints: set[str] = set()  # what kube-proxy currently routes to
        self.stats = ProxyStats()
        self.port: int | None = None
        self._rr = itertools.count()
        self._server: asyncio.AbstractServer | None = None
        self._watch: asyncio.Task | None = None
        self._service_watch: asyncio.Task | None = None
        self._pods: dict[str, dict[str, Any]] = {}  # the latest version of each pod seen
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> None:
        # The state kube-proxy would already have when the stand-in is first asked for: the
        # Service's current endpoints, without waiting for the watches' first events.
        await self._selector()
        resp = await self.client.get(f"/api/v1/namespaces/{self.namespace}/pods")
        if resp.status_code == 200:
            for pod in resp.json().get("items") or []:
                self._pods[pod["metadata"]["name"]] = pod
                self._set(pod["metadata"]["name"], _matches(pod, self.selector or {}) and _ready(pod))
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self._watch = asyncio.create_task(watch(
            self.client, f"/api/v1/namespaces/{self.namespace}/pods", self._on_pod))
        self._service_watch = asyncio.create_task(watch(
            self.client, f"/api/v1/namespaces/{self.namespace}/services", self._on_service))

    async def stop(self) -> None:
        for task in (self._watch, self._service_watch):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _selector(self) -> dict[str, str]:
        if self.selector is None:
            resp = await self.client.get(
                f"/api/v1/namespaces/{self.namespace}/services/{self.service}")
            if resp.status_code == 200:
                self.selector = dict((resp.json().get("spec") or {}).get("selector") or {})
        return self.selector or {}

    async def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        if kind == "DELETED":
            self._pods.pop(name, None)
        else:
            self._pods[name] = pod
        member = kind != "DELETED" and _matches(pod, await self._selector()) and _ready(pod)
        loop = asyncio.get_running_loop()
        loop.call_later(self.propagation_s, self._set, name, member)

    async def _on_service(self, kind: str, svc: dict[str, Any]) -> None:
        if svc["metadata"]["name"] != self.service or kind == "DELETED":
            return
        selector = dict((svc.get("spec") or {}).get("selector") or {})
        if selector == self.selector:
            return
        log.info("service %s: selector %s", self.service, selector)
        self.selector = selector
        loop = asyncio.get_running_loop()
        for name, pod in list(self._pods.items()):
            loop.call_later(self.propagation_s, self._set, name, _matches(pod, selector) and _ready(pod))

    def _set(self, name: str, member: bool) -> None:
        if member and name not in self.endpoints:
            log.info("service %s: + %s", self.service, name)
            self.endpoints.add(name)
        elif not member and name in self.endpoints:
            log.info("service %s: - %s", self.service, name)
            self.endpoints.discard(name)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            backends = sorted(self.endpoints)
            address = None
            if backends:
                name = backends[next(self._rr) % len(backends)]
                address = self.address_of(name)
            if address is None:
                self.stats.refused += 1
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*address)
            except OSError:
                self.stats.refused += 1
                return
            self.stats.connections[name] = self.stats.connections.get(name, 0) + 1
            await _splice(reader, writer, up_reader, up_writer)
        except asyncio.CancelledError:
            pass
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _splice(cr: asyncio.StreamReader, cw: asyncio.StreamWriter,
                  ur: asyncio.StreamReader, uw: asyncio.StreamWriter) -> None:
    """Bytes both ways until either side closes; then both are closed."""
    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()

    tasks = [asyncio.create_task(pipe(cr, uw)), asyncio.create_task(pipe(ur, cw))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        uw.close()
        with contextlib.suppress(Exception):
            await uw.wait_closed()


class ClusterServices:
    """One ServiceProxy per Service, started on first use; the kubelet's cluster DNS."""

    def __init__(self, api_url: str, namespace: str,
                 address_of: Callable[[str], tuple[str, int] | None],
                 propagation_s: float = 0.5) -> None:
        self.namespace = namespace
        self.address_of = address_of
        self.propagation_s = propagation_s
        self.client = httpx.AsyncClient(base_url=api_url.rstrip("/"), timeout=10)
        self.proxies: dict[str, ServiceProxy] = {}
        self._lock = asyncio.Lock()

    async def proxy(self, service: str) -> ServiceProxy:
        async with self._lock:
            if service not in self.proxies:
                p = ServiceProxy(self.client, self.namespace, service, self.address_of,
                                 self.propagation_s)
                await p.start()
                self.proxies[service] = p
            return self.proxies[service]

    async def url(self, service: str) -> str:
        return f"http://127.0.0.1:{(await self.proxy(service)).port}"

    async def address(self, service: str, port: int) -> str | None:
        """DNS + Service port: where `<service>:<port>` is reached; None if no such Service."""
        resp = await self.client.get(f"/api/v1/namespaces/{self.namespace}/services/{service}")
        if resp.status_code != 200:
            return None
        ports = [p.get("port") for p in (resp.json().get("spec") or {}).get("ports") or []]
        if port not in ports:
            return None
        return f"127.0.0.1:{(await self.proxy(service)).port}"

    async def __aenter__(self) -> ClusterServices:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for p in self.proxies.values():
            await p.stop()
        await self.client.aclose()
