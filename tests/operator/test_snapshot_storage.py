"""Issue 31: is spec.snapshot.size big enough? The pure check (operator/snapshot_storage.py),
how its inputs are read from an engine's /metrics (operator/engine_facts.py) and where it
lands in the status (status.compute). The operator against the API emulator and stand-in
engines: test_snapshot_storage_kmock.py."""

from __future__ import annotations

import pytest
from operator_sim import T0, World, rfc3339

from preheat.engine.metrics import Metrics
from preheat.operator import engine_facts
from preheat.operator.quantity import parse_quantity
from preheat.operator.scrape import parse_gauges
from preheat.operator.snapshot_storage import (
    CONDITION,
    KEEP,
    EngineFacts,
    StorageCheck,
    check,
    snapshot_bytes,
)
from preheat.operator.status import Observation, compute

# Llama 3 8B in bfloat16: 32 layers x (K, V) x 8 KV heads x 128 x 2 bytes.
LLAMA_8B = EngineFacts(kv_bytes_per_token=32 * 2 * 8 * 128 * 2, max_tokens=65536)


def test_the_snapshots_need_bytes_per_token_times_max_tokens_times_keep_plus_two():
    assert KEEP == 3
    assert snapshot_bytes(EngineFacts(1000, 2000)) == 1000 * 2000 * 5
    assert snapshot_bytes(LLAMA_8B) == 40 * 2**30  # 8 GiB each, five of them


def test_the_default_10Gi_is_too_small_for_an_8b_model_at_the_default_max_tokens():
    v = check(StorageCheck(enabled=True, shared=False, size="10Gi", cache_weights=True,
                           facts=LLAMA_8B))
    assert (v.status, v.reason) == ("False", "SnapshotStorageTooSmall")
    assert (v.needed_bytes, v.size_bytes) == (40 * 2**30, 10 * 2**30)
    # The numbers and the ways out are in the message.
    for text in ("131072 bytes per token", "65536 tokens per snapshot", "3 kept",
                 str(40 * 2**30), "10Gi", "--snapshot-max-tokens", "at least 40Gi"):
        assert text in v.message, (text, v.message)
    assert v.condition() == {"type": CONDITION, "status": "False",
                             "reason": "SnapshotStorageTooSmall", "message": v.message}


@pytest.mark.parametrize("size, status", [("5000000", "True"), ("4999999", "False")])
def test_the_boundary_is_exact(size, status):
    v = check(StorageCheck(enabled=True, shared=False, size=size, cache_weights=True,
                           facts=EngineFacts(1000, 1000)))
    assert v.status == status and v.needed_bytes == 5_000_000


@pytest.mark.parametrize("shared, cache_weights, needed", [
    (True, True, 5_000_000 + 700_000),  # the converted weights live on the shared claim
    (True, False, 5_000_000),  # cacheWeights off: they stay on the pod's emptyDir
    (False, True, 5_000_000),  # a pod-local emptyDir holds snapshots only
])
def test_converted_weights_count_only_where_they_share_the_claim(shared, cache_weights, needed):
    facts = EngineFacts(1000, 1000, weight_cache_bytes=700_000)
    v = check(StorageCheck(enabled=True, shared=shared, size="5500000", cache_weights=cache_weights,
                           facts=facts))
    assert v.needed_bytes == needed
    assert v.status == ("True" if needed <= 5_500_000 else "False")
    assert ("converted weights" in v.message) == (needed > 5_000_000)
    assert ("downloads have their own volume" in v.message) == shared


def test_the_suggested_size_is_a_quantity_that_holds_what_is_needed():
    for facts in (EngineFacts(1000, 1000), LLAMA_8B, EngineFacts(46080, 4096, 300 << 20)):
        v = check(StorageCheck(enabled=True, shared=True, size="1Mi", cache_weights=True, facts=facts))
        suggested = v.message.split("at least ")[1].split(",")[0]
        assert parse_quantity(suggested) >= v.needed_bytes, (suggested, v.needed_bytes)
        again = check(StorageCheck(enabled=True, shared=True, size=suggested, cache_weights=True,
                                   facts=facts))
        assert again.status == "True"


def test_disabled_unknown_and_invalid():
    assert check(StorageCheck(False, False, "1Mi", True, LLAMA_8B)).reason == "SnapshotsDisabled"
    unknown = check(StorageCheck(True, False, "10Gi", True, None))
    assert (unknown.status, unknown.reason) == ("Unknown", "NotReported")
    bad = check(StorageCheck(True, False, "lots", True, LLAMA_8B))
    assert (bad.status, bad.reason) == ("False", "InvalidSize")


def test_the_facts_round_trip_through_the_status_for_their_template_only():
    entry = LLAMA_8B.as_status("h1")
    assert EngineFacts.from_status(entry, "h1") == LLAMA_8B
    assert EngineFacts.from_status(entry, "h2") is None  # a rollout: ask the new pods
    assert EngineFacts.from_status(None, "h1") is None
    assert EngineFacts.from_status({"templateHash": "h1", "kvBytesPerToken": "x"}, "h1") is None


def test_the_facts_are_read_from_the_engines_own_metrics_text():
    m = Metrics()
    text = m.render()[0].decode()
    assert engine_facts.facts_from(parse_gauges(text, engine_facts.GAUGES)) is None  # not loaded yet
    m.kv_bytes_per_token.set(46080)
    m.snapshot_max_tokens.set(65536)
    m.kv_capacity_tokens.set(4096)  # a snapshot holds at most what the pool holds
    m.weight_cache_bytes.set(270_000_000)
    text = m.render()[0].decode()
    assert engine_facts.facts_from(parse_gauges(text, engine_facts.GAUGES)) == \
        EngineFacts(46080, 4096, 270_000_000)
    m.kv_capacity_tokens.set(1_000_000)
    text = m.render()[0].decode()
    assert engine_facts.facts_from(parse_gauges(text, engine_facts.GAUGES)).max_tokens == 65536
    # An engine that publishes none of them (another image, an older version).
    assert engine_facts.facts_from(parse_gauges("other_gauge 1\n", engine_facts.GAUGES)) is None


def _pod(name, template="h1", phase="Running", ready=True, ip="10.0.0.1", role="serving"):
    return {"metadata": {"name": name, "labels": {"preheat.dev/template-hash": template,
                                                  "preheat.dev/role": role}},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {"phase": phase, "podIP": ip, "conditions": [
                {"type": "ContainersReady", "status": "True" if ready else "False"}]}}


def test_a_few_running_pods_of_the_current_template_are_asked_ready_first():
    pods = [_pod("d-starting", ready=False, ip="10.0.0.4"), _pod("c-old", template="h0"),
            _pod("b-pending", phase="Pending"), _pod("a-no-ip", ip=None),
            _pod("e-ready", ip="10.0.0.5"), _pod("f-ready", ip="10.0.0.6"),
            _pod("g-ready", ip="10.0.0.7")]
    assert engine_facts.candidates(pods, "h1") == [
        "http://10.0.0.5:8000/metrics", "http://10.0.0.6:8000/metrics",
        "http://10.0.0.7:8000/metrics"]
    assert engine_facts.candidates(pods[:4], "h1") == ["http://10.0.0.4:8000/metrics"]


def _obs(w: World, **kw) -> Observation:
    base = dict(replicas=1, warm_pool=0, template_hash="h1", pods=tuple(w.observed()),
                snapshot_enabled=True, snapshot_phase=None, degraded=None, generation=1)
    return Observation(**{**base, **kw})


def _cond(st):
    return next(c for c in st["conditions"] if c["type"] == CONDITION)


def test_the_status_carries_the_condition_and_the_numbers_it_used():
    w = World(hash="h1")
    w.add("serving", ready=True)
    now = rfc3339(T0 + 10)
    unknown = compute(_obs(w), "sel", {}, now)
    assert _cond(unknown)["status"] == "Unknown" and "snapshotStorage" not in unknown
    small = compute(_obs(w, snapshot_size="10Gi", engine_facts=LLAMA_8B), "sel", unknown, now)
    assert (_cond(small)["status"], _cond(small)["reason"]) == ("False", "SnapshotStorageTooSmall")
    assert small["snapshotStorage"] == {"templateHash": "h1", "kvBytesPerToken": 131072,
                                        "maxTokens": 65536, "weightCacheBytes": 0,
                                        "neededBytes": 40 * 2**30, "sizeBytes": 10 * 2**30}
    big = compute(_obs(w, snapshot_size="40Gi", engine_facts=LLAMA_8B), "sel", small,
                  rfc3339(T0 + 20))
    assert (_cond(big)["status"], _cond(big)["reason"]) == ("True", "Sufficient")
    assert _cond(big)["lastTransitionTime"] == rfc3339(T0 + 20)
    # Snapshots turned off: the condition says so and the numbers go.
    off = compute(_obs(w, snapshot_enabled=False, engine_facts=None), "sel", big, now)
    assert _cond(off)["reason"] == "SnapshotsDisabled" and off["snapshotStorage"] is None
