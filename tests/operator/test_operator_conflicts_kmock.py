"""Issue 13 point 5 against the API emulator, with the real kopf operator: objects it does not
own are left alone and reported, and a Secret the pods cannot have (read off their
CreateContainerConfigError: the operator has no get on Secrets) is a condition, not more
pods that never start. The tests play the user, as in test_operator_kmock.py."""

from __future__ import annotations

from typing import Any

from test_operator_failover_kmock import condition, events_with, status_of
from test_operator_kmock import NS, eventually, pods_of, sample

from preheat.operator.kube import Kube
from preheat.operator.resources import HPAS, INFERENCE_SERVICES, PODS, PVCS, SERVICES

FOREIGN_SERVICE = {"metadata": {"name": "chat", "labels": {"team": "web"}},
                   "spec": {"selector": {"app": "web"},
                            "ports": [{"name": "web", "port": 80, "targetPort": 8080}]}}
FOREIGN_CLAIM = {"metadata": {"name": "chat-snapshots"},
                 "spec": {"accessModes": ["ReadWriteOnce"],
                          "resources": {"requests": {"storage": "1Gi"}}}}
FOREIGN_HPA = {"metadata": {"name": "chat", "ownerReferences": [
                   {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web",
                    "uid": "0000-web", "controller": True}]},
               "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                           "name": "web"},
                        "minReplicas": 1, "maxReplicas": 3}}
AUTOSCALING = {"minReplicas": 1, "maxReplicas": 3,
               "metric": {"type": "Pods", "name": "preheat_num_requests_waiting",
                          "targetAverageValue": "4"}}


def _essence(o: dict[str, Any]) -> tuple[Any, Any, Any]:
    meta = o["metadata"]
    return meta.get("resourceVersion"), meta.get("ownerReferences"), o.get("spec")


async def test_foreign_service_claim_and_hpa_are_reported_and_left_untouched(cluster: Kube):
    kube = cluster
    svc = await kube.create(SERVICES, NS, FOREIGN_SERVICE)
    claim = await kube.create(PVCS, NS, FOREIGN_CLAIM)
    hpa = await kube.create(HPAS, NS, FOREIGN_HPA)
    await kube.create(INFERENCE_SERVICES, NS, sample(
        "chat", replicas=1, snapshot={"storage": "SharedVolume"}, autoscaling=AUTOSCALING))

    async def degraded():
        st = await status_of(kube, "chat")
        d = condition(st, "Degraded")
        return st if d.get("status") == "True" else None
    st = await eventually(degraded)
    d = condition(st, "Degraded")
    assert st["phase"] == "Degraded"
    # The first conflict found gives the reason; the message names every one.
    assert d["reason"] == "PVCConflict"
    for named in ("PersistentVolumeClaim 'chat-snapshots'", "Service 'chat'",
                  "HorizontalPodAutoscaler 'chat'", "Deployment 'web'", "no owner reference"):
        assert named in d["message"]
    for reason in ("PVCConflict", "ServiceConflict", "HPAConflict"):
        [event] = await events_with(kube, reason)
        assert event["type"] == "Warning" and event["involvedObject"]["name"] == "chat"
    # A foreign claim blocks new pods (they would mount it); nothing foreign was changed.
    assert await pods_of(kube, "chat") == []
    assert _essence(await kube.get(SERVICES, NS, "chat")) == _essence(svc)
    assert _essence(await kube.get(PVCS, NS, "chat-snapshots")) == _essence(claim)
    assert _essence(await kube.get(HPAS, NS, "chat")) == _essence(hpa)
    # Their owners clear the names: the operator creates its own, pods follow, Degraded ends.
    await kube.delete(PVCS, NS, "chat-snapshots")

    async def pods_made():
        return await pods_of(kube, "chat")
    await eventually(pods_made)
    for res in (SERVICES, HPAS):
        await kube.delete(res, NS, "chat")
    uid = (await kube.get(INFERENCE_SERVICES, NS, "chat"))["metadata"]["uid"]

    async def healed():
        st = await status_of(kube, "chat")
        return condition(st, "Degraded").get("status") == "False"
    await eventually(healed)
    for res, name in ((SERVICES, "chat"), (HPAS, "chat"), (PVCS, "chat-snapshots")):
        made = await kube.get(res, NS, name)
        assert [r["uid"] for r in made["metadata"]["ownerReferences"]] == [uid]
    # Each conflict was an Event once, not once per pass of the many that ran meanwhile.
    for reason in ("PVCConflict", "ServiceConflict", "HPAConflict"):
        assert len(await events_with(kube, reason)) == 1


async def _kubelet_waits(kube: Kube, pod: str, message: str | None) -> None:
    """Plays the kubelet: the container Waiting in CreateContainerConfigError with the
    kubelet's own message (a missing Secret), or running once the Secret is there."""
    state = {"waiting": {"reason": "CreateContainerConfigError", "message": message}} if message \
        else {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
    await kube.patch(PODS, NS, pod, {"status": {"phase": "Pending" if message else "Running",
                                                "containerStatuses": [{"name": "engine", "ready": False,
                                                                       "restartCount": 0, "state": state}]}},
                     subresource="status")


async def test_a_missing_secret_is_read_off_the_pods_and_stops_new_pods(cluster: Kube):
    """The operator cannot read Secrets (no get in its role): the pods say the Secret is
    missing, the operator reports it (Degraded, an Event, naming the Secret and the field)
    and makes no new pods until the kubelet can start them."""
    kube = cluster
    await kube.create(INFERENCE_SERVICES, NS, sample(
        "auth", replicas=1, warmPool={"size": 1}, snapshot={"enabled": False},
        engine={"image": "preheat/engine:dev",
                "apiKeySecretRef": {"name": "llm-key", "key": "token"}}))

    async def two_pods():
        pods = await pods_of(kube, "auth")
        return sorted(p["metadata"]["name"] for p in pods) if len(pods) == 2 else None
    first, second = await eventually(two_pods)
    for pod in (first, second):
        await _kubelet_waits(kube, pod, 'secret "llm-key" not found')

    async def degraded():
        d = condition(await status_of(kube, "auth"), "Degraded")
        return d if d.get("status") == "True" else None
    d = await eventually(degraded)
    assert d["reason"] == "SecretNotFound"
    assert "Secret 'llm-key' (spec.engine.apiKeySecretRef) not found" in d["message"]
    [event] = await events_with(kube, "SecretNotFound")
    assert "Secret 'llm-key'" in event["message"] and event["type"] == "Warning"

    # The serving pod lost meanwhile is not replaced by a new pod: the replacement would
    # wait the same way. The warm one takes its place (the relabel shows a pass ran).
    [serving] = await pods_of(kube, "auth", role="serving")
    [warm] = await pods_of(kube, "auth", role="warm")
    await kube.delete(PODS, NS, serving["metadata"]["name"])

    async def promoted():
        return [p["metadata"]["name"] for p in await pods_of(kube, "auth", role="serving")] == \
            [warm["metadata"]["name"]]
    await eventually(promoted)
    [survivor] = await pods_of(kube, "auth")
    assert condition(await status_of(kube, "auth"), "Degraded")["status"] == "True"

    # The Secret is created; the kubelet starts the container: the operator heals.
    await _kubelet_waits(kube, survivor["metadata"]["name"], None)

    async def healed():
        pods = await pods_of(kube, "auth")
        ok = condition(await status_of(kube, "auth"), "Degraded").get("status") == "False"
        return pods if ok and len(pods) == 2 else None
    pods = await eventually(healed)
    for pod in pods:  # serving and warm alike
        env = pod["spec"]["containers"][0]["env"]
        assert {"name": "PREHEAT_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": "llm-key", "key": "token"}}} in env
    assert len(await events_with(kube, "SecretNotFound")) == 1  # once, not once per pass
