"""The real kopf operator against an emulated API server (kmock_apiserver.KubeAPIServer).

The tests play the user (create, scale, delete) and the kubelet (pod readiness), and
check what the operator did through the API, as a cluster user would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import yaml
from kmock_apiserver import CRD_PATH

from preheat.operator.kube import STRATEGIC, Kube
from preheat.operator.resources import (
    CONFIGMAPS,
    INFERENCE_SERVICES,
    PDBS,
    PODS,
    PVCS,
    SERVICES,
    WARM_CONDITION,
    Resource,
)

NS = "default"
EVENTS = Resource("", "v1", "events")
pytestmark = pytest.mark.timeout(60)


def sample(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "serving.preheat.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": {"path": "/models/smollm2"}, "engine": {"image": "preheat/engine:dev"},
                 **spec},
    }


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float = 15.0) -> Any:
    """Poll until check() returns a truthy value without raising AssertionError."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            result = await check()
            if result:
                return result
            error: Exception = AssertionError(f"{check.__name__} stayed {result!r}")
        except AssertionError as e:
            error = e
        if asyncio.get_running_loop().time() > deadline:
            raise error
        await asyncio.sleep(0.1)


async def pods_of(kube: Kube, name: str, role: str | None = None) -> list[dict[str, Any]]:
    """The service's engine pods (of `role`); role "router": its router pods."""
    labels = {"preheat.dev/service": name, **({"preheat.dev/role": role} if role else {})}
    return [p for p in await kube.list(PODS, NS, labels)
            if role == "router" or p["metadata"]["labels"].get("preheat.dev/role") != "router"]


def _now() -> str:
    import datetime
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


async def play_kubelet(kube: Kube, pod: dict[str, Any], ready: bool = True) -> None:
    """What the kubelet reports once the engine's /ready probe answers 200 (or stops)."""
    cond = {"type": "ContainersReady", "status": "True" if ready else "False",
            "lastTransitionTime": _now()}
    await kube.patch(PODS, NS, pod["metadata"]["name"],
                     {"status": {"phase": "Running", "conditions": [cond]}},
                     subresource="status", content_type=STRATEGIC)


def gate(pod: dict[str, Any]) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c["type"] == WARM_CONDITION:
            return c["status"]
    return None


async def test_a_service_gets_owned_children_exact_status_and_promotes_on_scale(cluster: Kube):
    kube = cluster
    await kube.create(CONFIGMAPS, NS, {"metadata": {"name": "templates"},
                                       "data": {"chat.yaml": "name: chat\n"}})
    created = await kube.create(INFERENCE_SERVICES, NS, sample(
        "chat", replicas=2, warmPool={"size": 1}, warmupTemplates={"configMap": "templates"},
        snapshot={"storage": "SharedVolume"}))
    uid = created["metadata"]["uid"]

    async def three_pods():
        pods = await pods_of(kube, "chat")
        return pods if len(pods) == 3 else None
    pods = await eventually(three_pods)
    roles = sorted(p["metadata"]["labels"]["preheat.dev/role"] for p in pods)
    assert roles == ["serving", "serving", "warm"]

    # Children are owned by the resource, so deleting it cascades.
    svc = await kube.get(SERVICES, NS, "chat")
    pvc = await kube.get(PVCS, NS, "chat-snapshots")
    pdb = await kube.get(PDBS, NS, "chat")
    for child in [*pods, svc, pvc, pdb]:
        assert [r["uid"] for r in child["metadata"]["ownerReferences"]] == [uid]
    assert pdb["spec"]["selector"]["matchLabels"] == {"preheat.dev/service": "chat",
                                                      "preheat.dev/role": "serving"}
    assert svc["spec"]["selector"] == {"preheat.dev/service": "chat", "preheat.dev/role": "serving"}
    spec = pods[0]["spec"]
    assert spec["readinessGates"] == [{"conditionType": WARM_CONDITION}]
    assert {v["name"] for v in spec["volumes"]} >= {"snapshots", "warmup-templates"}

    async def status_while_warming():
        st = (await kube.get(INFERENCE_SERVICES, NS, "chat")).get("status") or {}
        return st if st.get("replicas") == 2 else None
    st = await eventually(status_while_warming)
    assert st["selector"] == "preheat.dev/role=serving,preheat.dev/service=chat"
    assert st["readyReplicas"] == 0 and st["phase"] == "Pending"
    assert all(gate(p) != "True" for p in await pods_of(kube, "chat"))

    # The kubelet sees /ready turn 200 on every pod: the operator opens the warm gates.
    for pod in pods:
        await play_kubelet(kube, pod)

    async def ready():
        st = (await kube.get(INFERENCE_SERVICES, NS, "chat")).get("status") or {}
        return st if st.get("phase") == "Ready" else None
    st = await eventually(ready)
    assert (st["replicas"], st["readyReplicas"], st["warmReplicas"]) == (2, 2, 1)
    assert st["observedGeneration"] == 1
    conds = {c["type"]: c["status"] for c in st["conditions"]}
    assert conds["Ready"] == "True" and conds["WarmPoolReady"] == "True"
    assert conds["Degraded"] == "False"
    assert all(gate(p) == "True" for p in await pods_of(kube, "chat"))

    # Scale through the /scale subresource, as an HPA does: the warm pod is promoted.
    [warm] = await pods_of(kube, "chat", "warm")
    scale = await kube.patch(INFERENCE_SERVICES, NS, "chat", {"spec": {"replicas": 3}},
                             subresource="scale")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3

    async def promoted():
        serving = {p["metadata"]["name"] for p in await pods_of(kube, "chat", "serving")}
        return warm["metadata"]["name"] in serving and len(serving) == 3
    await eventually(promoted)

    async def pool_backfilled():
        return len(await pods_of(kube, "chat", "warm")) == 1
    await eventually(pool_backfilled)
    # The status follows the pods within one reconcile pass.
    async def status_after_scale():
        st = (await kube.get(INFERENCE_SERVICES, NS, "chat"))["status"]
        return (st["replicas"], st["readyReplicas"], st["observedGeneration"]) == (3, 3, 2)
    await eventually(status_after_scale)

    # Every promotion is an event on the resource.
    async def promotion_event():
        events = await kube.list(EVENTS, NS, {})
        return [e for e in events if e.get("reason") == "Promoted"
                and warm["metadata"]["name"] in e.get("message", "")]
    await eventually(promotion_event)

    # Deleting the resource removes everything it owns.
    await kube.delete(INFERENCE_SERVICES, NS, "chat")

    async def gone():
        return (await kube.get(INFERENCE_SERVICES, NS, "chat") is None
                and not await pods_of(kube, "chat")
                and await kube.get(SERVICES, NS, "chat") is None
                and await kube.get(PVCS, NS, "chat-snapshots") is None)
    await eventually(gone)


async def test_a_dead_pod_is_replaced(cluster: Kube):
    kube = cluster
    await kube.create(INFERENCE_SERVICES, NS, sample("solo", replicas=1,
                                                     snapshot={"enabled": False}))
    async def one_pod():
        pods = await pods_of(kube, "solo")
        return pods if len(pods) == 1 else None
    [first] = await eventually(one_pod)
    await kube.patch(PODS, NS, first["metadata"]["name"], {"status": {"phase": "Failed"}},
                     subresource="status")

    async def replaced():
        names = [p["metadata"]["name"] for p in await pods_of(kube, "solo", "serving")]
        return len(names) == 1 and names[0] != first["metadata"]["name"]
    await eventually(replaced)


async def test_bad_specs_are_reported_as_degraded_not_crashes(cluster: Kube):
    kube = cluster
    await kube.create(INFERENCE_SERVICES, NS, sample(
        "nocm", warmupTemplates={"configMap": "missing"}))
    # Two model sources: the CRD's CEL rule refuses this (the emulator admits like the API
    # server); the operator must still cope if it gets through, e.g. on a cluster whose CRD
    # is older. So install such a CRD first, through the API as kubectl would.
    older = yaml.safe_load(CRD_PATH.read_text())
    older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"] \
        .pop("x-kubernetes-validations")
    await kube._call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body=older)
    bad = sample("twosrc")
    bad["spec"]["model"] = {"path": "/a", "uri": "hf://b"}
    await kube.create(INFERENCE_SERVICES, NS, bad)

    async def degraded(name: str, reason: str):
        st = (await kube.get(INFERENCE_SERVICES, NS, name)).get("status") or {}
        conds = {c["type"]: c for c in st.get("conditions") or []}
        d = conds.get("Degraded") or {}
        return st.get("phase") == "Degraded" and d.get("status") == "True" \
            and d.get("reason") == reason
    await eventually(lambda: degraded("nocm", "WarmupTemplatesNotFound"))
    await eventually(lambda: degraded("twosrc", "InvalidModelSource"))
    assert await pods_of(kube, "nocm") == [] and await pods_of(kube, "twosrc") == []

    # Fixing the cause heals it: the ConfigMap appears, pods follow.
    await kube.create(CONFIGMAPS, NS, {"metadata": {"name": "missing"}, "data": {}})
    async def healed():
        return len(await pods_of(kube, "nocm")) == 1
    await eventually(healed)
