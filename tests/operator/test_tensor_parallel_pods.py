"""spec.engine.tensorParallelSize: the flag, one GPU per rank, a memory-backed /dev/shm with a
size limit for NCCL — rendered into pods that the CRD and Kubernetes 1.30's schemas accept;
single-rank pods stay exactly as they were."""

from __future__ import annotations

import crd_schema
import kubernetes_validate
import pytest

from preheat.operator import render
from preheat.operator.spec import SpecError, parse_spec

K8S = "1.30.0"
UID = "0b5f7e4e-5d0b-4c59-9d43-1b1f1e0c0a11"


def cr(**engine) -> dict:
    return {"apiVersion": "serving.preheat.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "svc"},
            "spec": {"model": {"path": "/m"}, "engine": {"image": "img", **engine}}}


def pod_of(obj: dict) -> dict:
    obj = crd_schema.apply_defaults(obj, crd_schema.load_schema())
    assert crd_schema.errors(obj) == []
    pod = render.pod("svc", "default", UID, parse_spec(obj["spec"]), "svc-abc123", "warm")
    kubernetes_validate.validate(pod, K8S, strict=True)
    return pod


def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def shm_of(pod: dict) -> dict:
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
    (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "dshm"]
    assert mount["mountPath"] == "/dev/shm"
    return volume["emptyDir"]


def test_ranks_become_the_flag_gpus_and_a_sized_shared_memory():
    pod = pod_of(cr(tensorParallelSize=4, resources={"limits": {"memory": "96Gi"}, "requests": {"cpu": "8"}}))
    assert env_of(pod)["PREHEAT_TENSOR_PARALLEL_SIZE"] == "4"
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources == {"limits": {"memory": "96Gi", "nvidia.com/gpu": 4}, "requests": {"cpu": "8"}}
    assert shm_of(pod) == {"medium": "Memory", "sizeLimit": "4Gi"}


def test_a_gpu_count_the_user_gave_that_matches_is_kept():
    pod = pod_of(cr(tensorParallelSize=2, resources={"limits": {"nvidia.com/gpu": "2"}}))
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2


@pytest.mark.parametrize("kind", ["limits", "requests"])
def test_a_gpu_count_that_disagrees_is_refused_naming_both(kind):
    obj = crd_schema.apply_defaults(cr(tensorParallelSize=2, resources={kind: {"nvidia.com/gpu": 1}}),
                                    crd_schema.load_schema())  # fmt: skip
    with pytest.raises(SpecError, match=rf"resources.{kind}\['nvidia.com/gpu'\] is 1 but engine.tensorParallelSize is 2"):
        parse_spec(obj["spec"])


def test_one_rank_leaves_the_pod_as_it_was():
    default, explicit = pod_of(cr()), pod_of(cr(tensorParallelSize=1))
    assert default == explicit
    assert "PREHEAT_TENSOR_PARALLEL_SIZE" not in env_of(default)
    assert "resources" not in default["spec"]["containers"][0]
    assert shm_of(default) == {"medium": "Memory"}
    assert render.template_hash(pod_of(cr(tensorParallelSize=2))["spec"]) != render.template_hash(default["spec"])


@pytest.mark.parametrize("size,message", [(0, "less than the minimum of 1"), (17, "greater than the maximum of 16"),
                                          ("2", "is not of type 'integer'")])
def test_the_crd_refuses_sizes_out_of_range(size, message):
    assert any(message in e for e in crd_schema.errors(cr(tensorParallelSize=size)))
