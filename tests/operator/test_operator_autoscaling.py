"""The built-in autoscaler (autoscaling.metric.type Engine) with the real kopf operator
against the emulated API server, and stand-in engines (fake_engines.py): each pod gets its
own loopback IP with an HTTP server on the engine port that serves the engine's real
metrics registry, whose gauges the test sets. The test plays the kubelet
(pod IP, readiness) and the load; the operator must scrape only the Ready serving pods,
set spec.replicas through /scale, promote warm pods, report its decision and post Events.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fake_engines import NS, FakeEngines, operator_with_engines

from preheat.operator.kube import Kube
from preheat.operator.resources import CONFIGMAPS, HPAS, INFERENCE_SERVICES, PODS, Resource

EVENTS = Resource("", "v1", "events")
pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def cluster(tmp_path, monkeypatch) -> AsyncIterator[tuple[Kube, FakeEngines]]:
    async with operator_with_engines(tmp_path, monkeypatch, resync_seconds=1.0,
                                     autoscale_interval=0.2, metrics_timeout=0.5) as both:
        yield both


async def eventually(check, timeout: float = 20.0) -> Any:
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


async def pods_by_role(kube: Kube, name: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"serving": [], "warm": []}
    for p in await kube.list(PODS, NS, {"preheat.dev/service": name}):
        if p["metadata"]["labels"].get("preheat.dev/role") == "router":
            continue  # not an engine
        out.setdefault(p["metadata"]["labels"]["preheat.dev/role"], []).append(p["metadata"]["name"])
    return out


def autoscaled(name: str, **auto: Any) -> dict[str, Any]:
    return {
        "apiVersion": "serving.preheat.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": {}, "engine": {"image": "preheat/engine:dev"}, "replicas": 1,
                 "warmPool": {"size": 1}, "snapshot": {"enabled": False},
                 "autoscaling": {"minReplicas": 1, "maxReplicas": 3, "metric": {
                     "type": "Engine", "name": "preheat_num_requests_waiting",
                     "targetAverageValue": 2}, **auto}},
    }


async def test_engine_load_scales_up_by_promotion_and_back_down_after_the_window(cluster):
    kube, engines = cluster
    await kube.create(INFERENCE_SERVICES, NS, autoscaled(
        "chat", scaleUpStabilizationSeconds=0, scaleDownStabilizationSeconds=2))

    async def started():
        r = await pods_by_role(kube, "chat")
        return r if (len(r["serving"]), len(r["warm"])) == (1, 1) else None
    first = await eventually(started)
    [serving], [warm] = first["serving"], first["warm"]
    await engines.ready(serving)
    await engines.ready(warm)

    # Idle: the decision is recorded, nothing moves.
    async def idle_decision():
        st = ((await kube.get(INFERENCE_SERVICES, NS, "chat")).get("status") or {}).get("autoscaling")
        return st if st and st.get("reason") in ("TooFewReplicas", "ScaleDownStabilized",
                                                 "WithinTolerance") else None
    st = await eventually(idle_decision)
    assert (st["currentReplicas"], st["desiredReplicas"], st["reportingPods"]) == (1, 1, 1)
    assert st["currentAverageValue"] == 0 and st["metric"] == "preheat_num_requests_waiting"

    # A busy warm pod takes no traffic: its gauge must never count, nor be asked for.
    engines.load(warm, 50)
    await asyncio.sleep(1.0)
    assert (await kube.get(INFERENCE_SERVICES, NS, "chat"))["spec"]["replicas"] == 1
    assert engines.scrapes[warm] == 0 and engines.scrapes[serving] > 0
    engines.load(warm, 0)

    # Load on the one serving pod: 6 waiting vs a target of 2 -> 3 replicas, through /scale.
    engines.load(serving, 6)

    async def scaled_up():
        # /scale is written first, the status right after it in the same pass.
        body = await kube.get(INFERENCE_SERVICES, NS, "chat")
        st = (body.get("status") or {}).get("autoscaling") or {}
        return body if body["spec"]["replicas"] == 3 and st.get("lastScaleTime") else None
    body = await eventually(scaled_up)
    st = body["status"]["autoscaling"]
    assert (st["reason"], st["desiredReplicas"], st["currentAverageValue"]) == ("ScaleUp", 3, 6)
    assert st["lastScaleTime"]
    scale = await kube.get(INFERENCE_SERVICES, NS, "chat", subresource="scale")
    assert scale["spec"]["replicas"] == 3  # what `kubectl get --subresource=scale` and an HPA see

    # The warm pod is promoted first; the rest are created, and the pool is refilled.
    async def promoted():
        r = await pods_by_role(kube, "chat")
        return r if warm in r["serving"] and len(r["serving"]) == 3 and len(r["warm"]) == 1 else None
    roles = await eventually(promoted)
    for pod in roles["serving"] + roles["warm"]:
        await engines.ready(pod)

    async def events_posted():  # kopf posts Events from a background queue
        reasons = [(e.get("reason"), e.get("message", "")) for e in await kube.list(EVENTS, NS, {})]
        assert any(r == "SuccessfulRescale" and m.startswith("New size: 3;") for r, m in reasons), reasons
        assert any(r == "Promoted" and warm in m for r, m in reasons), reasons
        return True
    await eventually(events_posted)
    assert await kube.get(HPAS, NS, "chat") is None  # Engine mode creates no HPA

    # Load spreads and ends: back to minReplicas once the 2 s down-window has passed.
    for pod in roles["serving"]:
        engines.load(pod, 0)

    scaled_up_at = st["lastScaleTime"]

    async def scaled_down():
        # The pass after the scale-down already reports TooFewReplicas (0 recommended, min 1):
        # the scale-down itself shows in lastScaleTime and its Event.
        body = await kube.get(INFERENCE_SERVICES, NS, "chat")
        st = (body.get("status") or {}).get("autoscaling") or {}
        return body["spec"]["replicas"] == 1 and st.get("desiredReplicas") == 1 \
            and st.get("lastScaleTime") != scaled_up_at
    await eventually(scaled_down)

    # The pool is full: both leaving serving pods go gracefully — out of the Service's
    # endpoints first (role=draining), deleted once the endpoint delay has passed.

    async def one_serving_two_draining():
        r = await pods_by_role(kube, "chat")
        return r if len(r["serving"]) == 1 and len(r["warm"]) == 1 \
            and len(r.get("draining", [])) == 2 else None
    drained = set((await eventually(one_serving_two_draining))["draining"])
    assert drained <= set(roles["serving"])

    async def drained_and_deleted():
        names = {n for ns in (await pods_by_role(kube, "chat")).values() for n in ns}
        reasons = [(e.get("reason"), e.get("message", "")) for e in await kube.list(EVENTS, NS, {})]
        return not (names & drained) and all(
            any(r == "Draining" and p in m for r, m in reasons)
            and any(r == "Drained" and p in m for r, m in reasons) for p in drained)
    await eventually(drained_and_deleted)

    async def scale_down_event():
        return any(e.get("reason") == "SuccessfulRescale" and e["message"].startswith("New size: 1;")
                   for e in await kube.list(EVENTS, NS, {}))
    await eventually(scale_down_event)


async def test_an_autoscaled_scale_down_demotes_into_a_pool_below_size_and_drains_the_rest(cluster):
    """Issue 19: scale-down by the built-in autoscaler takes serving pods out gracefully, and
    a ready serving pod goes back into the warm pool instead when the pool is below size.
    The pool is kept below size here by a missing warmup ConfigMap (Degraded: no new pods)
    and a deleted warm pod."""
    kube, engines = cluster
    await kube.create(CONFIGMAPS, NS, {"metadata": {"name": "tpl"}, "data": {"t.yaml": "name: t\n"}})
    body = autoscaled("shrink", scaleUpStabilizationSeconds=0, scaleDownStabilizationSeconds=1)
    body["spec"]["warmupTemplates"] = {"configMap": "tpl"}
    body["spec"]["readiness"] = {"endpointDelaySeconds": 1, "terminationGracePeriodSeconds": 30}
    await kube.create(INFERENCE_SERVICES, NS, body)

    async def started():
        r = await pods_by_role(kube, "shrink")
        return r if (len(r["serving"]), len(r["warm"])) == (1, 1) else None
    first = await eventually(started)
    [serving], [warm] = first["serving"], first["warm"]
    await engines.ready(serving)
    await engines.ready(warm)
    engines.load(serving, 6)  # 6 waiting vs a target of 2: 3 replicas

    async def scaled_up():
        r = await pods_by_role(kube, "shrink")
        return r if len(r["serving"]) == 3 and len(r["warm"]) == 1 else None
    roles = await eventually(scaled_up)
    for pod in roles["serving"] + roles["warm"]:
        await engines.ready(pod)

    async def all_gated():
        pods = [p for p in await kube.list(PODS, NS, {"preheat.dev/service": "shrink"})
                if p["metadata"]["labels"].get("preheat.dev/role") != "router"]
        return all(any(c.get("type") == "preheat.dev/warm" and c.get("status") == "True"
                       for c in p["status"].get("conditions") or []) for p in pods)
    await eventually(all_gated)

    # No new pods from here on: the warmup ConfigMap is gone (Degraded); then the pool's
    # one warm pod goes, and is not replaced.
    await kube.delete(CONFIGMAPS, NS, "tpl")

    async def degraded():
        st = (await kube.get(INFERENCE_SERVICES, NS, "shrink")).get("status") or {}
        return any(c["type"] == "Degraded" and c["status"] == "True" for c in st.get("conditions") or [])
    await eventually(degraded)
    [refill] = roles["warm"]
    await kube.delete(PODS, NS, refill)

    async def pool_empty():
        return not (await pods_by_role(kube, "shrink"))["warm"]
    await eventually(pool_empty)

    for pod in roles["serving"]:
        engines.load(pod, 0)

    async def back_to_one():
        r = await pods_by_role(kube, "shrink")
        return r if len(r["serving"]) == 1 and len(r["warm"]) == 1 else None
    after = await eventually(back_to_one)
    [demoted] = after["warm"]
    assert demoted in roles["serving"]  # a former serving pod, not a new one
    reasons = [(e.get("reason"), e.get("message", "")) for e in await kube.list(EVENTS, NS, {})]
    assert any(r == "Demoted" and demoted in m for r, m in reasons), reasons
    [gone] = set(roles["serving"]) - set(after["serving"]) - {demoted}

    async def the_other_drained():
        names = {n for ns in (await pods_by_role(kube, "shrink")).values() for n in ns}
        reasons = [(e.get("reason"), e.get("message", "")) for e in await kube.list(EVENTS, NS, {})]
        return gone not in names and any(r == "Draining" and gone in m for r, m in reasons) \
            and any(r == "Drained" and gone in m for r, m in reasons)
    await eventually(the_other_drained)


async def test_unready_pods_are_not_asked_and_silence_is_reported_not_acted_on(cluster):
    kube, engines = cluster
    await kube.create(INFERENCE_SERVICES, NS, autoscaled("quiet", scaleDownStabilizationSeconds=0))

    async def started():
        r = await pods_by_role(kube, "quiet")
        return r if (len(r["serving"]), len(r["warm"])) == (1, 1) else None
    [serving] = (await eventually(started))["serving"]
    await engines.start(serving)
    engines.load(serving, 40)
    await engines.ready(serving, ok=False)  # the kubelet's verdict: not Ready

    await asyncio.sleep(1.5)  # several passes (every 0.2 s) that see the pod's IP

    async def no_metrics():
        st = ((await kube.get(INFERENCE_SERVICES, NS, "quiet")).get("status") or {}).get("autoscaling")
        return st if st and st["reason"] == "NoMetrics" else None
    st = await eventually(no_metrics)
    assert st["desiredReplicas"] == 1 and "currentAverageValue" not in st
    assert engines.scrapes[serving] == 0
    assert (await kube.get(INFERENCE_SERVICES, NS, "quiet"))["spec"]["replicas"] == 1

    async def warned_once():  # once per episode, not every pass
        events = await kube.list(EVENTS, NS, {})
        return [e["reason"] for e in events if e.get("reason") == "FailedGetEngineMetrics"] == \
            ["FailedGetEngineMetrics"]
    await eventually(warned_once)

    # Leaving Engine mode: the autoscaler stops and its status goes; an HPA takes over.
    await kube.patch(INFERENCE_SERVICES, NS, "quiet", {"spec": {"autoscaling": {"metric": {
        "type": "Pods", "name": "preheat_num_requests_waiting", "targetAverageValue": 2}}}})

    async def handed_to_an_hpa():
        body = await kube.get(INFERENCE_SERVICES, NS, "quiet")
        hpa = await kube.get(HPAS, NS, "quiet")
        return hpa is not None and "autoscaling" not in (body.get("status") or {})
    await eventually(handed_to_an_hpa)
