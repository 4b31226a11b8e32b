"""Several operator replicas with kopf peering: one acts, the others stand by and take over.

Each replica is the real kopf operator with Preheat's handlers, in its own thread and event
loop (as in its own process: kopf, when it stops, cancels every task of its loop it did
not start), against one emulated API server holding the chart's peering object.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import pathlib
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import kmock
import kopf
import pytest
from kmock_apiserver import KubeAPIServer, write_kubeconfig
from test_operator_kmock import NS, eventually, sample

from preheat.operator.config import OperatorConfig, startup_priority
from preheat.operator.kube import Kube
from preheat.operator.resources import INFERENCE_SERVICES, PODS, Resource

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "helm"))
from operator_api_usage import kopf_peering_verbs

PEERING = "preheat"
KOPF_PEERINGS = Resource("kopf.dev", "v1", "kopfpeerings")
pytestmark = pytest.mark.timeout(90)


@dataclass
class Replica:
    """One `preheat operator --peering` process: the operator's loop in a thread."""
    identity: str
    priority: int
    peering_lifetime: int = 20
    reconciles: list[str] = field(default_factory=list)  # "ns/name", one per reconcile pass
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    error: BaseException | None = None

    def start(self) -> None:
        from preheat.operator import handlers

        replica = self

        class CountingState(handlers.OperatorState):
            # reconcile_loop asks for a client once per pass: count who reconciles.
            def client(self) -> Kube:
                replica.reconciles.append("pass")
                return super().client()

        memo = CountingState(config=OperatorConfig(
            namespaces=(NS,), peering=PEERING, priority=self.priority, resync_seconds=1.0,
            peering_lifetime=self.peering_lifetime))

        def run() -> None:
            try:
                asyncio.run(kopf.operator(
                    peering_name=PEERING, priority=self.priority, identity=self.identity,
                    namespaces=[NS], memo=memo, stop_flag=self.stop))
            except asyncio.CancelledError:
                pass  # kopf ends its root task by cancellation when stopped
            except BaseException as e:
                self.error = e

        self.thread = threading.Thread(target=run, name=self.identity, daemon=True)
        self.thread.start()

    async def halt(self) -> None:
        self.stop.set()
        assert self.thread is not None
        await asyncio.to_thread(self.thread.join, 15)
        assert not self.thread.is_alive() and self.error is None, self.error


@pytest.fixture
async def cluster(tmp_path, monkeypatch) -> AsyncIterator[tuple[KubeAPIServer, Kube]]:
    """The emulated API server with what the chart installs for replicas > 1: the peering
    CRDs (declared by KubeAPIServer) and the KopfPeering in the watched namespace."""
    async with KubeAPIServer() as api, kmock.Server(api) as server:
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path, server.url)))
        user = Kube(kopf.ConnectionInfo(server=str(server.url).rstrip("/")))
        await user.create(KOPF_PEERINGS, NS, {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
                                             "metadata": {"name": PEERING}})
        try:
            yield api, user
        finally:
            await user.close()


@contextlib.asynccontextmanager
async def stopped_at_exit(*replicas: Replica) -> AsyncIterator[None]:
    """Whatever happens in the block, every replica still running is stopped after it."""
    try:
        yield
    finally:
        for r in replicas:
            if r.thread is not None and r.thread.is_alive():
                await r.halt()


async def pod_count(kube: Kube, name: str) -> int:
    """Engine pods (the router pods are not what these tests count)."""
    return len([p for p in await kube.list(PODS, NS, {"preheat.dev/service": name})
                if p["metadata"]["labels"].get("preheat.dev/role") != "router"])


async def peers(kube: Kube) -> dict[str, Any]:
    return (await kube.get(KOPF_PEERINGS, NS, PEERING) or {}).get("status") or {}


def rbac_verb(request: Any) -> str:
    if request.method == kmock.method.GET:
        return {kmock.action.WATCH: "watch", kmock.action.LIST: "list"}.get(request.action, "get")
    return {"POST": "create", "PATCH": "patch", "PUT": "update",
            "DELETE": "delete"}[str(request.method.value).upper()]


async def test_only_the_highest_priority_replica_acts_and_the_next_takes_over(cluster):
    api, kube = cluster
    # The default priorities: the replica that started first ranks higher.
    first = Replica("first", startup_priority(1_000_000_000))
    second = Replica("second", startup_priority(2_000_000_000))
    assert first.priority > second.priority

    async with stopped_at_exit(first, second):
        first.start()
        async def first_announced():
            return "first" in await peers(kube)
        await eventually(first_announced)
        # kopf starts a peered operator paused until it has read the peering object; the
        # second one reads the first's record there and stays paused.
        second.start()
        async def both_announced():
            return {"first", "second"} <= set(await peers(kube))
        await eventually(both_announced)

        await kube.create(INFERENCE_SERVICES, NS, sample("chat", replicas=2,
                                                         snapshot={"enabled": False}))
        async def two_pods():
            return await pod_count(kube, "chat") == 2
        await eventually(two_pods)
        await asyncio.sleep(2.0)  # two resyncs: a second actor would have shown by now
        assert await pod_count(kube, "chat") == 2  # no duplicates from a second actor
        assert first.reconciles and not second.reconciles

        # The active replica stops (a rollout, a drained node): it takes its record out of
        # the peering object on the way, and the standby resumes at once.
        await first.halt()
        async def first_left():
            return "first" not in await peers(kube)
        await eventually(first_left)
        await kube.create(INFERENCE_SERVICES, NS, sample("code", replicas=1,
                                                         snapshot={"enabled": False}))
        async def taken_over():
            return await pod_count(kube, "code") == 1 and second.reconciles
        await eventually(taken_over)

    # What kopf's peering did on the API is exactly what the chart's RBAC grants it.
    # (kopf's own requests, by its User-Agent: the test's user client reads the object too)
    used = {rbac_verb(r) for r in api if r.resource is not None and r.resource.group == "kopf.dev"
            and (r.headers.get("User-Agent") or "").startswith("kopf/")}
    assert used == kopf_peering_verbs()


async def test_a_replica_that_vanished_without_a_goodbye_blocks_until_its_record_expires(cluster):
    # A crashed leader cannot remove its record: the standby waits out the record's lifetime
    # (kopf's default is 60 s; this one is short) and then acts.
    _, kube = cluster
    lastseen = datetime.datetime.now(datetime.timezone.utc).isoformat()
    await kube.patch(KOPF_PEERINGS, NS, PEERING, {"status": {"crashed": {
        "priority": 10, "lifetime": 4, "lastseen": lastseen}}})
    standby = Replica("standby", 0)
    async with stopped_at_exit(standby):
        standby.start()
        await kube.create(INFERENCE_SERVICES, NS, sample("chat", replicas=1,
                                                         snapshot={"enabled": False}))
        await asyncio.sleep(2.0)
        assert await pod_count(kube, "chat") == 0 and not standby.reconciles  # paused
        async def acts_after_expiry():
            return await pod_count(kube, "chat") == 1
        await eventually(acts_after_expiry, timeout=15)
        # The standby also cleans the dead record out of the peering object.
        async def cleaned():
            return "crashed" not in await peers(kube)
        await eventually(cleaned)


async def test_a_replica_announces_the_configured_lifetime_so_its_crash_blocks_only_that_long(cluster):
    _, kube = cluster
    replica = Replica("short-lived", 5, peering_lifetime=17)
    async with stopped_at_exit(replica):
        replica.start()
        async def announced():
            return "short-lived" in await peers(kube)
        await eventually(announced)
        assert (await peers(kube))["short-lived"]["lifetime"] == 17

