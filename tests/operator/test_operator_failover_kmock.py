"""Issue 12 end to end against the API emulator: the real kopf operator fails over, drains,
reports rollouts that stall and claims that never bind, and keeps a retained claim.

The tests play the kubelet (pod conditions) as in test_operator_kmock.py; the engines and
the local kubelet harness are in e2e/ (test_chaos.py).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from test_operator_kmock import (
    EVENTS,
    NS,
    eventually,
    gate,
    play_kubelet,
    pods_of,
    sample,
)

from preheat.operator.kube import Kube
from preheat.operator.resources import INFERENCE_SERVICES, PVCS, SECRETS


async def status_of(kube: Kube, name: str) -> dict[str, Any]:
    return (await kube.get(INFERENCE_SERVICES, NS, name)).get("status") or {}


def condition(st: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions") or [] if c["type"] == ctype), {})


async def events_with(kube: Kube, reason: str) -> list[dict[str, Any]]:
    """The Events of that reason, once there is one (kopf posts them in the background)."""
    async def found():
        return [e for e in await kube.list(EVENTS, NS, {}) if e.get("reason") == reason]
    return await eventually(found)


async def ready_service(kube: Kube, name: str, **spec: Any) -> tuple[str, str]:
    """Creates a service of 1 serving + 1 warm pod and plays the kubelet until both are warm;
    returns (serving pod, warm pod)."""
    await kube.create(INFERENCE_SERVICES, NS, sample(name, replicas=1, warmPool={"size": 1},
                                                     **spec))

    async def two_pods():
        pods = await pods_of(kube, name)
        return pods if len(pods) == 2 else None
    for pod in await eventually(two_pods):
        await play_kubelet(kube, pod)

    async def settled():
        st = await status_of(kube, name)
        return st.get("phase") == "Ready" and all(gate(p) == "True" for p in await pods_of(kube, name))
    await eventually(settled)
    [serving] = await pods_of(kube, name, "serving")
    [warm] = await pods_of(kube, name, "warm")
    return serving["metadata"]["name"], warm["metadata"]["name"]


@pytest.mark.parametrize("resync_seconds", [60.0])
async def test_an_unready_serving_pod_is_failed_over_when_its_grace_ends(cluster: Kube):
    """With a 60 s resync, only the planner's recheck time can wake the operator in time."""
    kube = cluster
    grace = 2
    serving, warm = await ready_service(kube, "fo", failover={"unreadySeconds": grace},
                                        snapshot={"enabled": False})
    [pod] = [p for p in await pods_of(kube, "fo") if p["metadata"]["name"] == serving]
    await play_kubelet(kube, pod, ready=False)  # a hang: the readiness probe failed
    # lastTransitionTime has second precision: the grace ends within [grace-1, grace] s.
    unready_at = time.time()

    async def failed_over():
        names = {p["metadata"]["name"]: p["metadata"]["labels"]["preheat.dev/role"]
                 for p in await pods_of(kube, "fo")}
        return names.get(warm) == "serving" and serving not in names
    # Well before the 60 s resync: the planner's recheck woke the operator. (How soon after
    # the grace capacity is back is measured by benchmarks/chaos.py, not asserted here.)
    await eventually(failed_over, timeout=grace + 20)
    print(f"failed over {time.time() - unready_at:.2f}s after the pod turned unready")
    [event] = await events_with(kube, "FailedOver")
    assert serving in event["message"] and warm in event["message"]

    async def streak_in_status():  # written at the end of the pass that acted on the pods
        st = await status_of(kube, "fo")
        return st if (st.get("failover") or {}).get("count") == 1 else None
    st = await eventually(streak_in_status)
    assert condition(st, "FailoverBackoff")["status"] == "False"


async def test_a_ready_serving_pod_drains_out_of_the_endpoints_before_deletion(cluster: Kube):
    kube = cluster
    await kube.create(INFERENCE_SERVICES, NS, sample(
        "dr", replicas=2, snapshot={"enabled": False},
        readiness={"endpointDelaySeconds": 2, "terminationGracePeriodSeconds": 30}))

    async def two():
        pods = await pods_of(kube, "dr")
        return pods if len(pods) == 2 else None
    for pod in await eventually(two):
        await play_kubelet(kube, pod)

    async def both_ready():
        return (await status_of(kube, "dr")).get("readyReplicas") == 2
    await eventually(both_ready)
    await kube.patch(INFERENCE_SERVICES, NS, "dr", {"spec": {"replicas": 1}}, subresource="scale")

    async def draining():
        return [p for p in await pods_of(kube, "dr")
                if p["metadata"]["labels"]["preheat.dev/role"] == "draining"]
    [leaving] = await eventually(draining)
    name = leaving["metadata"]["name"]
    since = leaving["metadata"]["annotations"]["preheat.dev/draining-since"]
    assert since.endswith("Z")
    marked = time.time()

    async def deleted():
        return name not in {p["metadata"]["name"] for p in await pods_of(kube, "dr")}
    await eventually(deleted)
    assert time.time() - marked >= 0.9  # not at once: the endpoint delay (2 s) passed first
    assert await events_with(kube, "Draining") and await events_with(kube, "Drained")


@pytest.mark.parametrize("resync_seconds", [60.0])
async def test_a_rollout_that_stalls_reports_progress_deadline_exceeded(cluster: Kube):
    kube = cluster
    await ready_service(kube, "ro", snapshot={"enabled": False},
                        rollout={"progressDeadlineSeconds": 2})
    st = await status_of(kube, "ro")
    assert condition(st, "Progressing")["reason"] == "RolloutComplete"
    # A template change whose new pods never get warm (the kubelet is not played for them).
    await kube.patch(INFERENCE_SERVICES, NS, "ro", {"spec": {"engine": {
        "image": "preheat/engine:dev", "env": [{"name": "PREHEAT_LOG_LEVEL", "value": "debug"}]}}})

    async def stalled():
        st = await status_of(kube, "ro")
        c = condition(st, "Progressing")
        return st if c.get("status") == "False" and c.get("reason") == "ProgressDeadlineExceeded" \
            else None
    st = await eventually(stalled, timeout=20)
    # Every condition says which generation it describes.
    assert {c["observedGeneration"] for c in st["conditions"]} == {2}
    assert st["observedGeneration"] == 2
    assert await events_with(kube, "ProgressDeadlineExceeded")
    # The old serving pod still serves: a stalled rollout costs no capacity.
    assert st["readyReplicas"] == 1 and st["outdatedReplicas"] == 1


async def test_a_claim_that_never_binds_is_a_clear_condition(cluster: Kube):
    kube = cluster  # no provisioner here: the claim stays Pending, like RWX on RWO storage
    await kube.create(INFERENCE_SERVICES, NS, sample(
        "rwx", snapshot={"storage": "SharedVolume", "accessMode": "ReadWriteMany"}))

    async def pending():
        c = condition(await status_of(kube, "rwx"), "SnapshotVolumeBound")
        return c if c.get("status") == "False" else None
    c = await eventually(pending)
    assert c["reason"] == "ClaimPending" and "ReadWriteMany" in c["message"]
    assert "PodLocal" in c["message"]
    assert await events_with(kube, "ClaimPending")


async def test_a_retained_claim_outlives_its_service(cluster: Kube):
    kube = cluster
    await kube.create(INFERENCE_SERVICES, NS, sample(
        "keep", snapshot={"storage": "SharedVolume", "retainOnDelete": True}))

    async def claim():
        return await kube.get(PVCS, NS, "keep-snapshots")
    made = await eventually(claim)
    assert not made["metadata"].get("ownerReferences")
    # The peer secret that signs the snapshots lives with the claim, not the service.
    async def peer_secret():
        return await kube.get(SECRETS, NS, "keep-peer")
    secret = await eventually(peer_secret)
    assert [(r["kind"], r["uid"]) for r in secret["metadata"]["ownerReferences"]] == \
        [("PersistentVolumeClaim", made["metadata"]["uid"])]
    await kube.delete(INFERENCE_SERVICES, NS, "keep")

    async def pods_gone():
        return await kube.get(INFERENCE_SERVICES, NS, "keep") is None and \
            not await pods_of(kube, "keep")
    await eventually(pods_gone)
    assert await kube.get(PVCS, NS, "keep-snapshots") is not None
    kept = await kube.get(SECRETS, NS, "keep-peer")
    assert kept is not None and kept["data"] == secret["data"]
    # Turning retention off on a new service of that name hands the claim back to it.
    created = await kube.create(INFERENCE_SERVICES, NS, sample(
        "keep", snapshot={"storage": "SharedVolume", "retainOnDelete": False}))

    async def owned():
        c = await kube.get(PVCS, NS, "keep-snapshots")
        return [r["uid"] for r in c["metadata"].get("ownerReferences") or []] == \
            [created["metadata"]["uid"]]
    await eventually(owned)
    # ... and the same peer secret: its snapshots still verify (created once, a 409 since).
    again = await kube.get(SECRETS, NS, "keep-peer")
    assert (again["metadata"]["uid"], again["data"]) == (secret["metadata"]["uid"], secret["data"])

