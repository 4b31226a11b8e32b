"""The status as a pure function (preheat.operator.status.compute): issue 12's conditions."""

from __future__ import annotations

from operator_sim import T0, World, rfc3339

from preheat.operator.decide import FailoverHistory
from preheat.operator.status import Observation, compute


def obs(w: World, **kw) -> Observation:
    base = dict(replicas=1, warm_pool=1, template_hash="v1", pods=tuple(w.observed()),
                snapshot_enabled=True, snapshot_phase=None, degraded=None, generation=3)
    base.update(kw)
    return Observation(**base)


def cond(st: dict, ctype: str) -> dict:
    return next(c for c in st["conditions"] if c["type"] == ctype)


def steady() -> World:
    w = World()
    w.add("serving", ready=True)
    w.add("warm", ready=True)
    return w


def test_every_condition_carries_the_generation_it_describes():
    st = compute(obs(steady()), "sel", {}, rfc3339(T0 + 100))
    assert {c["type"] for c in st["conditions"]} == {
        "Ready", "WarmPoolReady", "SnapshotVolumeBound", "SnapshotStorageSufficient", "Degraded",
        "Progressing", "FailoverBackoff", "ModelUnavailable"}
    assert {c["observedGeneration"] for c in st["conditions"]} == {3}
    assert cond(st, "Progressing")["reason"] == "RolloutComplete"
    assert cond(st, "SnapshotVolumeBound")["reason"] == "PodLocal"
    assert st["phase"] == "Ready"


def test_a_warm_pod_counts_for_the_pool_only_once_its_gate_is_open():
    """The engine is warm (ContainersReady) but the operator has not opened its gate yet:
    the status must not say the pool is full, nor the service Ready, before it acts (a
    status computed from a list of pods taken after this pass's actions saw exactly this)."""
    from dataclasses import replace

    w = steady()
    [warm] = [p for p in w.pods.values() if p.role == "warm"]
    w.pods[warm.name] = replace(warm, gate=False, was_warm=False, gate_changed=None)
    st = compute(obs(w), "sel", {}, rfc3339(w.now))
    assert st["warmReplicas"] == 0 and cond(st, "WarmPoolReady")["status"] == "False"
    assert st["phase"] != "Ready"
    w.pods[warm.name] = warm  # the gate opened
    st = compute(obs(w), "sel", {}, rfc3339(w.now))
    assert st["warmReplicas"] == 1 and st["phase"] == "Ready"


def test_a_rollout_without_progress_past_its_deadline_is_reported():
    w = steady()
    rolling = obs(w, template_hash="v2", progress_deadline_seconds=60)
    first = compute(rolling, "sel", {}, rfc3339(T0 + 100))
    assert cond(first, "Progressing")["status"] == "True"
    assert cond(first, "Progressing")["reason"] == "RollingOut"
    # Nothing moved since: within the deadline still True, then False.
    later = compute(rolling, "sel", first, rfc3339(T0 + 150))
    assert cond(later, "Progressing")["status"] == "True"
    stalled = compute(rolling, "sel", later, rfc3339(T0 + 200))
    c = cond(stalled, "Progressing")
    assert (c["status"], c["reason"]) == ("False", "ProgressDeadlineExceeded")
    assert c["lastUpdateTime"] == rfc3339(T0 + 100)
    # A new pod of the template counts as progress: True again, the clock restarts.
    w.add("warm", hash="v2")
    moved = compute(obs(w, template_hash="v2", progress_deadline_seconds=60), "sel", stalled,
                    rfc3339(T0 + 210))
    assert cond(moved, "Progressing")["status"] == "True"
    assert cond(moved, "Progressing")["lastUpdateTime"] == rfc3339(T0 + 210)


def test_a_shared_claim_that_does_not_bind_says_why_and_what_to_do():
    st = compute(obs(steady(), snapshot_shared=True, snapshot_phase="Pending",
                     snapshot_access_mode="ReadWriteMany"), "sel", {}, rfc3339(T0))
    c = cond(st, "SnapshotVolumeBound")
    assert (c["status"], c["reason"]) == ("False", "ClaimPending")
    assert "ReadWriteMany" in c["message"] and "PodLocal" in c["message"]


def test_unschedulable_pods_are_named_in_the_ready_condition():
    w = World()
    p = w.add("serving")
    w.unschedulable(p.name)
    c = cond(compute(obs(w), "sel", {}, rfc3339(T0)), "Ready")
    assert c["reason"] == "PodsUnschedulable" and "0/3 nodes are available" in c["message"]


def test_a_held_back_failover_is_a_condition_and_the_streak_is_kept():
    h = FailoverHistory(count=5, last=T0)
    st = compute(obs(steady(), history=h, backoff_until=T0 + 40), "sel", {}, rfc3339(T0 + 1))
    c = cond(st, "FailoverBackoff")
    assert (c["status"], c["reason"]) == ("True", "RepeatedFailures")
    assert st["failover"] == {"count": 5, "lastTime": rfc3339(T0)}


def test_a_serving_pod_on_a_lost_node_is_not_counted_ready():
    w = steady()
    [s] = w.serving()
    w.tick(10)
    w.lose_node(s.name)
    st = compute(obs(w), "sel", {}, rfc3339(w.now))
    assert st["readyReplicas"] == 0 and cond(st, "Ready")["status"] == "False"
