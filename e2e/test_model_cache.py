"""An InferenceService whose model comes from the hub stand-in (tests/standins/hub_server.py)
on the local harness: the first pod downloads into the shared model cache, the warm pod and
a scale-up read it from there (counted in bytes the stand-in served per file); with the
PodLocal cache (each pod its own emptyDir) the warm pod and a scale-up take the files from a
Ready peer instead; a service whose model does not exist reports ModelUnavailable with the
engine's message and does not storm pods."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from e2e import manifests
from e2e.local_cluster import local_cluster
from e2e.provisioner import ANY_MODE
from e2e.scenario import pods_of, status_of
from e2e.waiting import eventually
from preheat.operator.resources import INFERENCE_SERVICES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from standins.hub_server import HubStandIn
from tiny_models import build_tiny_model

# Each eventually() below has its own budget, and their sum stays under the test's timeout, so
# that a phase that does not finish fails with the cluster's diagnostics printed (a CI run once
# hit pytest-timeout here with no more than thread stacks to show; locally a run takes ~1 min).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = "test-org/tiny-llama"


def service(name: str, uri: str, hub_url: str, replicas: int = 1, warm_pool: int = 1,
            storage: str = "SharedVolume") -> dict:
    body = manifests.inference_service(name, replicas=replicas, warm_pool=warm_pool, templates=False,
                                       snapshot=False)
    body["spec"]["model"] = {"uri": uri, "cache": {"storage": storage, "size": "1Gi"}}
    body["spec"]["engine"]["env"] = [*body["spec"]["engine"]["env"],
                                     {"name": "HF_ENDPOINT", "value": hub_url},
                                     {"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"},
                                     {"name": "PREHEAT_DTYPE", "value": "float32"}]
    return body


def tiny_model(tmp_path: Path) -> Path:
    from transformers import AutoTokenizer

    from preheat.engine.model.loader import default_model_path

    gguf = Path(default_model_path())
    return build_tiny_model(tmp_path / "tiny", "llama", AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))


async def test_pod_local_caches_fill_from_a_ready_peer(tmp_path):
    tiny = tiny_model(tmp_path)
    with HubStandIn() as hub:
        hub.add(REPO, {p.name: p for p in tiny.iterdir() if p.is_file()})
        sizes = {(REPO, n): p.stat().st_size for n, p in hub.repos[REPO].files.items()}
        async with local_cluster(tmp_path / "node") as cluster:
            try:
                # One pod first: pods started together, before any is Ready, each ask the hub.
                await cluster.kube.create(INFERENCE_SERVICES, cluster.namespace,
                                          service("podlocal", f"hf://{REPO}", hub.url, warm_pool=0,
                                                  storage="PodLocal"))

                async def ready(replicas: int, warm: int):
                    st = await status_of(cluster, "podlocal")
                    assert (st.get("readyReplicas"), st.get("warmReplicas") or 0) == (replicas, warm), st
                    return st
                await eventually(lambda: ready(1, 0), 240, interval=0.5)
                assert hub.served == sizes
                # The warm pod and a scale-up past it: each its own emptyDir, filled from
                # the Ready peer over the engines' Service; the hub serves no more bytes.
                await cluster.kube.patch(INFERENCE_SERVICES, cluster.namespace, "podlocal",
                                         {"spec": {"warmPool": {"size": 1}, "replicas": 2}})
                await eventually(lambda: ready(2, 1), 240, interval=0.5)
                assert len(await pods_of(cluster, "podlocal")) == 3
                assert hub.served == sizes
            except BaseException:
                print(cluster.diagnostics())
                raise


async def test_pods_share_one_download(tmp_path):
    tiny = tiny_model(tmp_path)
    with HubStandIn() as hub:
        hub.add(REPO, {p.name: p for p in tiny.iterdir() if p.is_file()})
        sizes = {(REPO, n): p.stat().st_size for n, p in hub.repos[REPO].files.items()}
        async with local_cluster(tmp_path / "node", access_modes=ANY_MODE) as cluster:
            try:
                hub.rate = 4e6  # a download of some seconds, for the status to show it
                await cluster.kube.create(INFERENCE_SERVICES, cluster.namespace,
                                          service("hubbed", f"hf://{REPO}", hub.url))
                progress: list[dict] = []

                async def ready(replicas: int):
                    st = await status_of(cluster, "hubbed")
                    progress.extend((st.get("model") or {}).get("downloading") or [])
                    assert (st.get("readyReplicas"), st.get("warmReplicas")) == (replicas, 1), st
                    return st
                await eventually(lambda: ready(1), 240, interval=0.5)
                hub.rate = None
                # Two pods started, one download: every file served exactly once.
                assert hub.served == sizes
                # The status followed it: the pods' /ready bytes, the repository's total.
                assert any(0 < d["bytesDone"] <= d["bytesTotal"] == sum(sizes.values()) for d in progress), progress
                await cluster.kube.patch(INFERENCE_SERVICES, cluster.namespace, "hubbed", {"spec": {"replicas": 2}})
                await eventually(lambda: ready(2), 240, interval=0.5)
                assert len(await pods_of(cluster, "hubbed")) == 3  # the warm pod promoted, one refilled
                assert hub.served == sizes  # the scale-up and the refill read the cache

                # A model that is not there: the engines end at once with the reason, the
                # operator says so, and the kubelet's and failover back-offs pace the pods.
                await cluster.kube.create(INFERENCE_SERVICES, cluster.namespace,
                                          service("missing", "hf://test-org/no-such-model", hub.url))

                async def unavailable():
                    st = await status_of(cluster, "missing")
                    c = next((c for c in st.get("conditions") or [] if c["type"] == "ModelUnavailable"), {})
                    assert c.get("status") == "True", c
                    return c
                c = await eventually(unavailable, 180, interval=0.5)
                assert "hf://test-org/no-such-model: repository not found" in c["message"]
                created = {p["metadata"]["name"] for p in await pods_of(cluster, "missing")}
                assert len(created) <= 4, created  # 1 serving + 1 warm + failover surges, no storm
            except BaseException:
                print(cluster.diagnostics())
                raise
