"""Stand-in engines for the operator tests that run the real kopf operator against the
emulated API server and need pods that answer /metrics: each pod gets its own loopback IP
with an HTTP server on the engine port that serves the engine's real metrics registry
(preheat.engine.metrics.Metrics), whose gauges the test sets. The test plays the kubelet
(pod IP, readiness) through FakeEngines."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import AsyncIterator
from typing import Any

import kmock
import kopf
from aiohttp import web
from kmock_apiserver import KubeAPIServer, write_kubeconfig

from preheat.engine.metrics import Metrics
from preheat.operator.config import OperatorConfig
from preheat.operator.kube import STRATEGIC, Kube
from preheat.operator.resources import PODS

NS = "default"
ENGINE_PORT = 8000


def free_loopback_ip(port: int = ENGINE_PORT) -> str:
    """A 127.x.y.z address whose `port` is free: one 'pod IP' per fake engine."""
    for _ in range(100):
        ip = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}.{random.randint(1, 254)}"
        with socket.socket() as s:
            try:
                s.bind((ip, port))
                return ip
            except OSError:
                continue
    raise RuntimeError("no free loopback address")


class FakeEngines:
    """Plays the kubelet and the engines: every new pod gets an IP, a /metrics server and,
    when the test says so, a Ready status."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.metrics: dict[str, Metrics] = {}
        self.ips: dict[str, str] = {}
        self.scrapes: dict[str, int] = {}
        self._runners: list[web.AppRunner] = []

    async def start(self, pod: str) -> None:
        if pod in self.metrics:
            return
        metrics = self.metrics[pod] = Metrics()
        self.scrapes[pod] = 0

        async def serve(_: web.Request) -> web.Response:
            self.scrapes[pod] += 1
            body, ctype = metrics.render()
            return web.Response(body=body, headers={"Content-Type": ctype})
        app = web.Application()
        app.router.add_get("/metrics", serve)
        runner = web.AppRunner(app)
        await runner.setup()
        ip = self.ips[pod] = free_loopback_ip()
        await web.TCPSite(runner, ip, ENGINE_PORT).start()
        self._runners.append(runner)

    async def ready(self, pod: str, ok: bool = True) -> None:
        await self.start(pod)
        cond = {"type": "ContainersReady", "status": "True" if ok else "False"}
        await self.kube.patch(PODS, NS, pod, {"status": {
            "phase": "Running", "podIP": self.ips[pod], "conditions": [cond]}},
            subresource="status", content_type=STRATEGIC)

    def load(self, pod: str, waiting: float) -> None:
        self.metrics[pod].num_waiting.set(waiting)

    async def close(self) -> None:
        for r in self._runners:
            await r.cleanup()


@contextlib.asynccontextmanager
async def operator_with_engines(tmp_path, monkeypatch, **config: Any
                                ) -> AsyncIterator[tuple[Kube, FakeEngines]]:
    """The emulated API server, the operator (OperatorConfig(**config) in namespace NS)
    and stand-in engines; yields a user client and the engines."""
    async with KubeAPIServer() as api, kmock.Server(api) as server:
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path, server.url)))
        from preheat.operator import handlers

        stop = asyncio.Event()
        memo = handlers.OperatorState(config=OperatorConfig(
            namespaces=(NS,), standalone=True, **config))
        operator = asyncio.create_task(kopf.operator(
            standalone=True, namespaces=[NS], memo=memo, stop_flag=stop))
        user = Kube(kopf.ConnectionInfo(server=str(server.url).rstrip("/")))
        engines = FakeEngines(user)
        try:
            yield user, engines
        finally:
            stop.set()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(operator, timeout=10)
            await engines.close()
            await user.close()
        assert operator.cancelled() or operator.exception() is None
