"""spec.model.uri schemes, credentialsSecretRef, the model cache volume, and the
ModelUnavailable condition read from the engines' termination messages."""

from __future__ import annotations

import pytest

from preheat.operator import render
from preheat.operator.pods import view
from preheat.operator.spec import SpecError, parse_spec
from preheat.operator.status import Observation, compute

IMAGE = {"engine": {"image": "localhost/preheat-engine:dev"}}


def spec(model):
    return parse_spec({**IMAGE, "model": model})


def env(pod_spec):
    return {e["name"]: e.get("value") for e in pod_spec["containers"][0]["env"]}


def test_pvc_uri_is_the_same_as_model_pvc():
    by_uri = render.pod_spec("svc", spec({"uri": "pvc://weights/llama-3"}))
    by_pvc = render.pod_spec("svc", spec({"pvc": {"claimName": "weights", "path": "llama-3"}}))
    assert by_uri == by_pvc
    assert env(by_uri)["PREHEAT_MODEL"] == "/models/llama-3"
    claim = next(v for v in by_uri["volumes"] if v["name"] == "model")
    assert claim["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}


@pytest.mark.parametrize("uri", ["gs://bucket/model", "pvc:///path"])
def test_unknown_schemes_are_refused(uri):
    with pytest.raises(SpecError) as e:
        spec({"uri": uri})
    assert e.value.reason == "InvalidModelSource"


@pytest.mark.parametrize("storage, volume", [
    (None, {"name": "model-cache", "emptyDir": {}}),
    ("SharedVolume", {"name": "model-cache", "persistentVolumeClaim": {"claimName": "svc-model-cache"}}),
    ("NodeLocal", {"name": "model-cache", "hostPath": {"path": "/var/cache/preheat/models",
                                                       "type": "DirectoryOrCreate"}}),
])
def test_remote_models_download_into_the_cache_volume(storage, volume):
    model = {"uri": "hf://org/name", "credentialsSecretRef": {"name": "hf-token"}}
    if storage:
        model["cache"] = {"storage": storage}
    s = spec(model)
    pod = render.pod_spec("svc", s)
    c = pod["containers"][0]
    assert env(pod)["PREHEAT_MODEL"] == "hf://org/name"
    assert env(pod)["PREHEAT_DOWNLOAD_DIR"] == render.MODEL_CACHE_DIR
    assert volume in pod["volumes"]
    assert {"name": "model-cache", "mountPath": render.MODEL_CACHE_DIR} in c["volumeMounts"]
    # The Secret's keys (HF_TOKEN, AWS_*) reach the engine from the pod spec: the operator
    # never reads the Secret.
    assert c["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    # PodLocal: a new pod asks a Ready peer first, over the Service the snapshot fetch uses,
    # with the service's peer secret; a shared cache needs no peer.
    pod_local = storage is None
    assert env(pod).get("PREHEAT_MODEL_PEER_URL") == (render.peer_url("svc") if pod_local else None)
    if pod_local:
        assert env(pod)["PREHEAT_PEER_SECRET_FILE"] == "/etc/preheat/peer-secret"
        assert any(v["name"] == "peer-secret" for v in pod["volumes"])
    claim = render.model_cache_claim("svc", "ns", "uid-1", s)
    assert (claim is not None) == (storage == "SharedVolume")
    if claim:
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
        assert claim["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_a_pod_local_model_cache_brings_the_peer_secret_without_snapshots():
    s = parse_spec({**IMAGE, "model": {"uri": "hf://org/name"}, "snapshot": {"enabled": False}})
    pod = render.pod_spec("svc", s)
    assert s.needs_peer_secret and "PREHEAT_SNAPSHOT_DIR" not in env(pod)
    assert env(pod)["PREHEAT_MODEL_PEER_URL"] == render.peer_url("svc")
    assert env(pod)["PREHEAT_PEER_SECRET_FILE"] == "/etc/preheat/peer-secret"
    assert any(v["name"] == "peer-secret" for v in pod["volumes"])
    shared = parse_spec({**IMAGE, "model": {"uri": "hf://org/name", "cache": {"storage": "SharedVolume"}},
                         "snapshot": {"enabled": False}})
    assert not shared.needs_peer_secret
    assert "PREHEAT_MODEL_PEER_URL" not in env(render.pod_spec("svc", shared))


def test_local_models_get_no_cache_volume():
    pod = render.pod_spec("svc", spec({"path": "/opt/model"}))
    assert "PREHEAT_DOWNLOAD_DIR" not in env(pod)
    assert all(v["name"] != "model-cache" for v in pod["volumes"]) and "envFrom" not in pod["containers"][0]


def raw_pod(name, message, ready=False, template="v1"):
    return {
        "metadata": {"name": name, "labels": {"preheat.dev/role": "serving",
                                              "preheat.dev/template-hash": template},
                     "creationTimestamp": "2026-01-01T00:00:00Z"},
        "status": {"phase": "Running", "conditions": [
            {"type": "ContainersReady", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "engine", "restartCount": 2,
                                   "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                   "lastState": {"terminated": {"exitCode": 1, "message": message,
                                                                "finishedAt": "2026-01-01T00:01:00Z"}}}]},
    }


def model_condition(*pods):
    obs = Observation(replicas=1, warm_pool=0, template_hash="v1", pods=tuple(view(p) for p in pods),
                      snapshot_enabled=False, snapshot_phase=None, degraded=None, generation=1)
    st = compute(obs, "sel", {}, "2026-01-01T00:02:00Z")
    return next(c for c in st["conditions"] if c["type"] == "ModelUnavailable")


def test_model_unavailable_carries_the_engines_message():
    msg = "ModelUnavailable: hf://org/missing: repository not found, or access refused"
    c = model_condition(raw_pod("svc-a", msg))
    assert c["status"] == "True" and c["reason"] == "ModelNotFoundOrRefused"
    assert "hf://org/missing: repository not found" in c["message"] and "svc-a" in c["message"]


def test_other_exits_and_a_ready_pod_clear_it():
    assert model_condition(raw_pod("svc-a", "RuntimeError: CUDA out of memory"))["status"] == "False"
    msg = "ModelUnavailable: hf://org/missing: repository not found"
    assert model_condition(raw_pod("svc-a", msg), raw_pod("svc-b", "", ready=True))["status"] == "False"
    assert model_condition(raw_pod("svc-a", msg, template="v0"))["status"] == "False"  # an old template's


def test_only_running_unready_pods_are_asked_for_progress():
    from preheat.operator.model_progress import candidates

    def p(name, phase="Running", ready="False", ip="10.0.0.7"):
        return {"metadata": {"name": name}, "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
                "status": {"phase": phase, "podIP": ip, "conditions": [{"type": "ContainersReady", "status": ready}]}}
    pods = [p("starting"), p("ready", ready="True"), p("pending", phase="Pending"), p("no-ip", ip=None)]
    assert candidates(pods) == {"starting": "http://10.0.0.7:8000/ready"}


async def test_download_progress_is_read_from_the_503_ready_body():
    """/ready is 503 until the pod serves; the progress is in that body (a read that
    raised on the status saw no pod downloading)."""
    import httpx

    from preheat.operator.model_progress import downloading

    def ready(request: httpx.Request) -> httpx.Response:
        body = b'{"phase": "downloading", "bytes_done": 5, "bytes_total": 9, "source": "peer"}'
        return httpx.Response(503, stream=httpx.ByteStream(body))

    pod = raw_pod("p-1", None)
    pod["status"]["podIP"] = "10.0.0.7"
    async with httpx.AsyncClient(transport=httpx.MockTransport(ready)) as client:
        got = await downloading(client, [pod])
    assert got == [{"pod": "p-1", "bytesDone": 5, "bytesTotal": 9}]
