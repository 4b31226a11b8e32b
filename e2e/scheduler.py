"""The local scheduler (TEST HARNESS): binds each new pod of one namespace to a harness node,
or leaves it Pending with `PodScheduled=False`, reason `Unschedulable`, as kube-scheduler
does. The decision is e2e/placement.place(); this is its watch loop.

Binding writes `spec.nodeName` with a patch (the emulator has no pods/binding subresource);
the local kubelet runs only pods bound to one of its nodes. An unschedulable pod is retried
every `retry_s` and whenever a pod or claim changes, like the scheduler's backoff queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from typing import Any

import httpx

from e2e.nodes import ClusterNodes
from e2e.placement import ClaimInfo, place
from e2e.provisioner import NODE_ANNOTATION
from e2e.watch import watch

log = logging.getLogger("e2e.scheduler")
STRATEGIC = {"Content-Type": "application/strategic-merge-patch+json"}
SERVICE_LABEL = "preheat.dev/service"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _live(pod: dict[str, Any]) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and \
        (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


class LocalScheduler:
    def __init__(self, api_url: str, namespace: str, nodes: ClusterNodes,
                 retry_s: float = 1.0) -> None:
        self.namespace = namespace
        self.nodes = nodes
        self.retry_s = retry_s
        self._client = httpx.AsyncClient(base_url=api_url.rstrip("/"), timeout=10)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.bindings: dict[str, str] = {}  # pod name -> node, every binding made

    async def __aenter__(self) -> LocalScheduler:
        base = f"/api/v1/namespaces/{self.namespace}"
        self._tasks = [
            asyncio.create_task(watch(self._client, f"{base}/pods", self._poke)),
            asyncio.create_task(watch(self._client, f"{base}/persistentvolumeclaims", self._poke)),
            asyncio.create_task(self._loop()),
        ]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()

    def poke(self) -> None:
        self._wake.set()

    async def _poke(self, kind: str, obj: dict[str, Any]) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            with contextlib.suppress(httpx.HTTPError):
                await self._round()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.retry_s)

    async def _round(self) -> None:
        base = f"/api/v1/namespaces/{self.namespace}"
        pods = (await self._client.get(f"{base}/pods")).json().get("items") or []
        claims = {
            c["metadata"]["name"]: ClaimInfo(
                phase=(c.get("status") or {}).get("phase") or "Pending",
                node=(c["metadata"].get("annotations") or {}).get(NODE_ANNOTATION))
            for c in (await self._client.get(f"{base}/persistentvolumeclaims")).json().get("items") or []
        }
        for pod in pods:
            if (pod.get("spec") or {}).get("nodeName") or not _live(pod):
                continue
            service = (pod["metadata"].get("labels") or {}).get(SERVICE_LABEL)
            load: dict[str, int] = {}
            for other in pods:
                node = (other.get("spec") or {}).get("nodeName")
                if node and _live(other) and \
                        (other["metadata"].get("labels") or {}).get(SERVICE_LABEL) == service:
                    load[node] = load.get(node, 0) + 1
            placement = place(pod, self.nodes.all(), claims, load)
            name = pod["metadata"]["name"]
            if placement.node is not None:
                await self._bind(name, placement.node)
                load[placement.node] = load.get(placement.node, 0) + 1
                pod.setdefault("spec", {})["nodeName"] = placement.node
            else:
                await self._unschedulable(pod, placement.message)

    async def _bind(self, name: str, node: str) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods/{name}"
        resp = await self._client.patch(path, json={"spec": {"nodeName": node}},
                                        headers={"Content-Type": "application/merge-patch+json"})
        if resp.status_code != 200:
            return
        self.bindings[name] = node
        log.info("pod %s: bound to %s", name, node)
        await self._client.patch(f"{path}/status", headers=STRATEGIC, json={"status": {
            "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}]}})

    async def _unschedulable(self, pod: dict[str, Any], message: str) -> None:
        conds = {c.get("type"): c for c in (pod.get("status") or {}).get("conditions") or []}
        old = conds.get("PodScheduled") or {}
        if old.get("status") == "False" and old.get("message") == message:
            return
        log.info("pod %s: unschedulable: %s", pod["metadata"]["name"], message)
        since = old.get("lastTransitionTime") if old.get("status") == "False" else _now()
        await self._client.patch(
            f"/api/v1/namespaces/{self.namespace}/pods/{pod['metadata']['name']}/status",
            headers=STRATEGIC, json={"status": {"phase": "Pending", "conditions": [{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": message, "lastTransitionTime": since or _now()}]}})
