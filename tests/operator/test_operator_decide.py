"""Specification of the reconciler's decisions (preheat.operator.decide), no API involved."""

from __future__ import annotations

from operator_sim import World

from preheat.operator.decide import (
    CreatePod,
    DeletePod,
    Relabel,
    SetWarmGate,
    Target,
    desired_state,
)


def kinds(actions):
    return sorted(type(a).__name__ for a in actions)


def test_fresh_service_creates_serving_pods_and_the_warm_pool():
    actions = desired_state(Target(replicas=2, warm_pool=1, template_hash="v1"), [])
    assert sorted((a.role, a.reason) for a in actions) == [
        ("serving", "ScaledUp"), ("serving", "ScaledUp"), ("warm", "PoolBackfill")]


def test_scale_up_promotes_ready_warm_pods_before_creating_any():
    w = World()
    s = w.add("serving", ready=True)
    w1, w2 = w.add("warm", ready=True), w.add("warm", ready=True)
    actions = desired_state(Target(replicas=3, warm_pool=2, template_hash="v1"), w.observed())
    promoted = [a.pod for a in actions if isinstance(a, Relabel)]
    assert sorted(promoted) == sorted([w1.name, w2.name])
    assert all(a.role == "serving" and a.reason == "Promoted"
               for a in actions if isinstance(a, Relabel))
    # The pool is backfilled with new pods, none created directly as serving.
    assert [a.role for a in actions if isinstance(a, CreatePod)] == ["warm", "warm"]
    assert s.name not in promoted


def test_scale_up_prefers_a_ready_warm_pod_over_an_older_starting_one():
    w = World()
    starting = w.add("warm", ready=False)
    ready = w.add("warm", ready=True)
    actions = desired_state(Target(1, 2, "v1"), w.observed())
    assert Relabel(ready.name, "serving", "Promoted") in actions
    assert not any(isinstance(a, Relabel) and a.pod == starting.name for a in actions)


def test_scale_up_without_warm_pods_creates_serving_pods():
    w = World()
    w.add("serving", ready=True)
    actions = desired_state(Target(3, 0, "v1"), w.observed())
    assert actions == [CreatePod("serving", "ScaledUp")] * 2


def test_scale_down_demotes_into_the_pool_while_it_has_room():
    w = World()
    a, b, c = (w.add("serving", ready=True) for _ in range(3))
    actions = desired_state(Target(1, 1, "v1"), w.observed())
    # Newest go first: c is demoted into the one free pool slot, b is deleted.
    assert actions == [Relabel(c.name, "warm", "Demoted"), DeletePod(b.name, "ScaledDown")]


def test_scale_down_with_a_full_pool_deletes_the_newest_serving_pod():
    w = World()
    w.add("serving", ready=True)  # the older one stays
    new = w.add("serving", ready=True)
    w.add("warm", ready=True)
    assert desired_state(Target(1, 1, "v1"), w.observed()) == [DeletePod(new.name, "ScaledDown")]


def test_scale_down_removes_an_unready_serving_pod_before_a_ready_one():
    w = World()
    unready = w.add("serving", ready=False)
    w.add("serving", ready=True)
    assert desired_state(Target(1, 0, "v1"), w.observed()) == [DeletePod(unready.name, "ScaledDown")]


def test_a_dead_serving_pod_is_replaced():
    w = World()
    dead = w.add("serving", ready=False, phase="Failed")
    w.add("serving", ready=True)
    actions = desired_state(Target(2, 0, "v1"), w.observed())
    assert actions == [DeletePod(dead.name, "Replaced"), CreatePod("serving", "ScaledUp")]


def test_a_dead_serving_pod_is_replaced_by_a_ready_warm_pod_first():
    w = World()
    dead = w.add("serving", phase="Failed")
    warm = w.add("warm", ready=True)
    actions = desired_state(Target(1, 1, "v1"), w.observed())
    assert actions == [DeletePod(dead.name, "Replaced"),
                       Relabel(warm.name, "serving", "Promoted"),
                       CreatePod("warm", "PoolBackfill")]


def test_terminating_pods_are_neither_counted_nor_touched():
    w = World()
    p = w.add("serving", ready=True)
    from dataclasses import replace
    w.pods[p.name] = replace(p, terminating=True)
    assert desired_state(Target(1, 0, "v1"), w.observed()) == [CreatePod("serving", "ScaledUp")]


def test_the_warm_gate_follows_the_kubelets_readiness_verdict():
    w = World()
    p = w.add("serving", ready=False)
    w.warm_up([p.name])  # containers ready, gate not yet set
    assert desired_state(Target(1, 0, "v1"), w.observed()) == [SetWarmGate(p.name, True)]


def test_no_pods_are_created_while_degraded_but_scaling_down_still_works():
    w = World()
    w.add("serving", ready=True)
    w.add("serving", ready=True)
    actions = desired_state(Target(3, 1, "v1", allow_create=False), w.observed())
    assert actions == []
    assert kinds(desired_state(Target(1, 0, "v1", allow_create=False), w.observed())) == ["DeletePod"]


def test_reconciling_twice_on_the_same_world_changes_nothing():
    w = World()
    w.add("serving", ready=True)
    w.add("warm", ready=False, hash="old")
    target = Target(2, 2, "v1")
    once = desired_state(target, w.observed())
    assert desired_state(target, w.observed()) == once
    w.apply(once, "v1")
    # Applied, and no pod changed state since: the next reconcile has nothing to add.
    assert desired_state(target, w.observed()) == []


