"""The operator's router children: the pure plan and renderings, then the real kopf operator
against the API emulator (router pods, `<name>-engines`, the client Service's switch)."""

from __future__ import annotations

import pytest
from test_operator_kmock import NS, eventually, pods_of, sample

from preheat.operator import render_router
from preheat.operator.kube import STRATEGIC, Kube
from preheat.operator.pods import PodView
from preheat.operator.resources import INFERENCE_SERVICES, PDBS, PODS, SERVICES
from preheat.operator.router_children import router_plan
from preheat.operator.spec import parse_spec

pytestmark = pytest.mark.timeout(60)
SPEC = parse_spec({"engine": {"image": "e:1", "imagePullSecrets": [{"name": "reg"}]},
                   "router": {"resources": {"limits": {"cpu": "1", "memory": "256Mi"}}}})


def rv(name: str, h: str = "H", ready: bool = False, phase: str = "Running",
       created: str = "2026-01-01T00:00:00Z") -> PodView:
    return PodView(name=name, role="router", template_hash=h, created=created, phase=phase,
                   ready_condition="True" if ready else "False")


def test_router_spec_defaults_and_bounds():
    spec = parse_spec({"engine": {"image": "e"}})
    assert (spec.router.enabled, spec.router.replicas, spec.router.resources) == (True, 2, {})
    with pytest.raises(Exception, match="router.replicas"):
        parse_spec({"engine": {"image": "e"}, "router": {"replicas": 0}})


def test_router_plan_creates_to_count_replaces_dead_and_rolls_with_a_surge():
    assert router_plan([], 2, "H").create == 2
    p = router_plan([rv("a", ready=True), rv("b", phase="Failed")], 2, "H")
    assert (p.create, p.delete) == (1, ("b",))
    # A new template: the old pods stay until as many new ones are Ready.
    old = [rv("a", "OLD", True), rv("b", "OLD", True)]
    assert router_plan(old, 2, "H") == router_plan(old, 2, "H").__class__(2, ())
    half = old + [rv("c", ready=True), rv("d")]
    assert router_plan(half, 2, "H").delete == ()
    done = old + [rv("c", ready=True), rv("d", ready=True)]
    assert set(router_plan(done, 2, "H").delete) == {"a", "b"}
    # Too many: the unready / newest go; disabled: all go.
    many = [rv("a", ready=True), rv("b", ready=True), rv("c", created="2026-01-02T00:00:00Z")]
    assert router_plan(many, 2, "H").delete == ("c",)
    assert set(router_plan(many, 0, "H").delete) == {"a", "b", "c"}


def test_router_pods_are_no_engines_and_keep_the_engines_security_settings():
    pod = render_router.router_pod("chat", NS, "uid", SPEC, "chat-router-abc123", "op:1")
    labels = pod["metadata"]["labels"]
    assert labels["preheat.dev/role"] == "router" and labels["preheat.dev/service"] == "chat"
    spec = pod["spec"]
    [c] = spec["containers"]
    assert c["command"] == ["preheat", "router"] and c["image"] == "op:1"
    assert "readinessGates" not in spec  # no warm gate
    assert "nvidia.com/gpu" not in str(c.get("resources"))
    assert c["resources"] == {"limits": {"cpu": "1", "memory": "256Mi"}}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    assert spec["serviceAccountName"] == "preheat-router" and spec["automountServiceAccountToken"]
    assert spec["imagePullSecrets"] == [{"name": "reg"}]
    assert {e["name"]: e.get("value") for e in c["env"]}["PREHEAT_ROUTER_SERVICE"] == "chat"
    assert render_router.router_pod_name("x" * 52, "abc123") == "x" * 52 + "-r-abc123"
    svc = render_router.engines_service("chat", NS, "uid")
    assert svc["spec"]["clusterIP"] == "None" and svc["metadata"]["name"] == "chat-engines"
    assert svc["spec"]["selector"] == {"preheat.dev/service": "chat", "preheat.dev/role": "serving"}
    off = parse_spec({"engine": {"image": "e"}, "router": {"enabled": False}})
    serving = {"preheat.dev/service": "chat", "preheat.dev/role": "serving"}
    assert render_router.client_selector("chat", SPEC, router_ready=False) == serving
    assert render_router.client_selector("chat", off, router_ready=True) == serving
    assert render_router.client_selector("chat", SPEC, True)["preheat.dev/role"] == "router"


async def ready(kube: Kube, pod: dict) -> None:
    await kube.patch(PODS, NS, pod["metadata"]["name"], {"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]}},
        subresource="status", content_type=STRATEGIC)


async def test_the_client_service_switches_to_the_routers_once_one_is_ready(cluster: Kube):
    kube = cluster
    created = await kube.create(INFERENCE_SERVICES, NS, sample("chat", replicas=1))
    uid = created["metadata"]["uid"]

    async def routers():
        pods = await pods_of(kube, "chat", "router")
        return pods if len(pods) == 2 else None
    pods = await eventually(routers)

    async def children():
        found = [await kube.get(SERVICES, NS, "chat-engines"), await kube.get(PDBS, NS, "chat-router"),
                 await kube.get(PDBS, NS, "chat")]
        return found if all(found) else None
    engines, budget, engine_budget = await eventually(children)
    for child in (engines, budget, *pods):
        assert [r["uid"] for r in child["metadata"]["ownerReferences"]] == [uid]
    assert budget["spec"]["selector"]["matchLabels"]["preheat.dev/role"] == "router"
    assert engine_budget["spec"]["selector"]["matchLabels"]["preheat.dev/role"] == "serving"
    serving = {"preheat.dev/service": "chat", "preheat.dev/role": "serving"}
    assert (await kube.get(SERVICES, NS, "chat"))["spec"]["selector"] == serving  # none Ready yet

    async def status():
        st = (await kube.get(INFERENCE_SERVICES, NS, "chat")).get("status") or {}
        return st if st.get("router") else None
    st = await eventually(status)
    assert st["router"]["summary"] == "0/2" and st["router"]["serviceSelects"] == "serving"
    assert st["replicas"] == 1  # routers are not engine replicas
    assert st["selector"] == "preheat.dev/role=serving,preheat.dev/service=chat"

    await ready(kube, pods[0])

    async def switched():
        svc = await kube.get(SERVICES, NS, "chat")
        return svc if svc["spec"]["selector"]["preheat.dev/role"] == "router" else None
    await eventually(switched)

    async def one_ready():  # the status is written after the Service, later in the pass
        st = await status()
        return st if st and st["router"]["readyReplicas"] == 1 else None
    st = await eventually(one_ready)
    assert st["router"] == {"replicas": 2, "readyReplicas": 1, "summary": "1/2", "serviceSelects": "router"}

    # Router off: its pods go, the Service selects the engines again.
    await kube.patch(INFERENCE_SERVICES, NS, "chat", {"spec": {"router": {"enabled": False}}})

    async def back():
        svc = await kube.get(SERVICES, NS, "chat")
        left = await pods_of(kube, "chat", "router")
        live = [p for p in left if not p["metadata"].get("deletionTimestamp")]
        return svc["spec"]["selector"] == serving and not live and \
            await kube.get(PDBS, NS, "chat-router") is None
    await eventually(back)

    async def router_status_gone():
        st = (await kube.get(INFERENCE_SERVICES, NS, "chat")).get("status") or {}
        return st.get("router") is None
    await eventually(router_status_gone)
