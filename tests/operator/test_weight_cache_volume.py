"""Converted GGUF weights live on the shared snapshot volume (snapshot.storage:
SharedVolume), so only the first pod of a service pays the conversion; without that volume
(the default, PodLocal) they stay on the pod's own emptyDir."""

from __future__ import annotations

import pytest

from preheat.operator import render
from preheat.operator.spec import parse_spec


def engine_env(spec: dict) -> dict[str, str]:
    pod = render.pod("svc", "ns", "uid-1", parse_spec(spec), "svc-abc123", "warm")
    (container,) = pod["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"]}


def mounted_at(spec: dict, directory: str) -> str:
    """Name of the volume that holds `directory` inside the engine container."""
    pod = render.pod("svc", "ns", "uid-1", parse_spec(spec), "svc-abc123", "warm")
    (container,) = pod["spec"]["containers"]
    best = max((m for m in container["volumeMounts"] if directory.startswith(m["mountPath"] + "/")),
               key=lambda m: len(m["mountPath"]))
    return best["name"]


BASE = {"engine": {"image": "img"}}
SHARED = {**BASE, "snapshot": {"storage": "SharedVolume"}}


def test_with_a_shared_volume_the_weight_cache_is_on_it():
    env = engine_env(SHARED)
    assert env["PREHEAT_WEIGHT_CACHE_DIR"] == "/var/lib/preheat/snapshots/weights"
    assert mounted_at(SHARED, env["PREHEAT_WEIGHT_CACHE_DIR"]) == "snapshots"
    pod = render.pod("svc", "ns", "uid-1", parse_spec(SHARED), "svc-abc123", "warm")
    [snap] = [v for v in pod["spec"]["volumes"] if v["name"] == "snapshots"]
    assert snap["persistentVolumeClaim"]["claimName"] == "svc-snapshots"


@pytest.mark.parametrize(
    "snapshot",
    [{}, {"enabled": False}, {"storage": "SharedVolume", "cacheWeights": False}],
    ids=["pod-local snapshots (default)", "no snapshots", "weight caching turned off"],
)
def test_otherwise_it_is_on_the_pods_own_cache_dir(snapshot):
    spec = {**BASE, "snapshot": snapshot}
    env = engine_env(spec)
    assert env["PREHEAT_WEIGHT_CACHE_DIR"] == "/var/cache/preheat/weights"
    assert mounted_at(spec, env["PREHEAT_WEIGHT_CACHE_DIR"]) == "cache"


def test_the_user_can_still_point_it_elsewhere():
    spec = {**BASE, "engine": {"image": "img", "env": [{"name": "PREHEAT_WEIGHT_CACHE_DIR", "value": "off"}]}}
    assert engine_env(spec)["PREHEAT_WEIGHT_CACHE_DIR"] == "off"
