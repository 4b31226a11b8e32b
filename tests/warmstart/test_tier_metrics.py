"""The KV-tier metrics follow the engine's own counters: hits by tier, L2->L1 restore times
(drained from the engine so each is observed once), L3 evictions."""

from __future__ import annotations

from types import SimpleNamespace

from preheat.engine.metrics import Metrics


def fake_engine(l1=0, l2=0, l3=0, restores=(), disk_evictions=0):
    l3_store = SimpleNamespace(stats=SimpleNamespace(evictions=disk_evictions))
    return SimpleNamespace(
        tier_hit_tokens={"l1": l1, "l2": l2, "l3": l3},
        tier_restore_seconds=list(restores),
        tiers=SimpleNamespace(l2=None, l3=l3_store),
    )


def sample(m: Metrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, labels or None)


def test_tier_hits_restore_times_and_disk_evictions_are_exported():
    m = Metrics()
    engine = fake_engine(l1=160, l2=32, l3=16, restores=[0.001, 0.004], disk_evictions=3)
    m.record_tiers(engine)
    assert sample(m, "preheat_kv_tier_hit_tokens_total", tier="l1") == 160
    assert sample(m, "preheat_kv_tier_hit_tokens_total", tier="l2") == 32
    assert sample(m, "preheat_kv_tier_hit_tokens_total", tier="l3") == 16
    assert sample(m, "preheat_l2_to_l1_latency_seconds_count") == 2
    assert sample(m, "preheat_l2_to_l1_latency_seconds_sum") == 0.005
    assert sample(m, "preheat_kv_disk_evictions_total") == 3
    assert engine.tier_restore_seconds == []  # drained: the next sync does not count them again


def test_a_second_sync_adds_only_what_changed():
    m = Metrics()
    engine = fake_engine(l1=100, restores=[0.002], disk_evictions=1)
    m.record_tiers(engine)
    engine.tier_hit_tokens["l1"] = 148
    engine.tier_hit_tokens["l3"] = 16
    engine.tiers.l3.stats.evictions = 4
    m.record_tiers(engine)
    m.record_tiers(engine)  # nothing new
    assert sample(m, "preheat_kv_tier_hit_tokens_total", tier="l1") == 148
    assert sample(m, "preheat_kv_tier_hit_tokens_total", tier="l3") == 16
    assert sample(m, "preheat_l2_to_l1_latency_seconds_count") == 1
    assert sample(m, "preheat_kv_disk_evictions_total") == 4


def test_an_engine_without_tiers_exports_zeros():
    m = Metrics()
    m.record_tiers(SimpleNamespace())
    assert sample(m, "preheat_kv_tier_hit_tokens_total", tier="l2") == 0
    assert sample(m, "preheat_kv_disk_evictions_total") == 0
