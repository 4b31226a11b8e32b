"""Issue 12's rules on the pure planner (preheat.operator.decide.plan): failover from the
warm pool, back-off, Deployment-like rollouts warm first, and draining before deletion."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st
from operator_sim import World, settle

from preheat.operator.decide import (
    BACKOFF_BASE_S,
    FREE_FAILOVERS,
    CreatePod,
    DeletePod,
    FailoverHistory,
    Relabel,
    Retire,
    Target,
    failover_delay,
    plan,
)

GRACE = 5.0
EXAMPLES = int(os.environ.get("PREHEAT_HYPOTHESIS_EXAMPLES", 150))


def target(replicas=1, warm=1, hash="v1", **kw) -> Target:
    kw.setdefault("unready_seconds", GRACE)
    return Target(replicas, warm, hash, **kw)


def steady(replicas=1, warm=1) -> World:
    w = World()
    for _ in range(replicas):
        w.add("serving", ready=True)
    for _ in range(warm):
        w.add("warm", ready=True)
    return w


# -- failover ---------------------------------------------------------------------------------

def test_a_serving_pod_whose_container_died_is_covered_at_once():
    """A dead container is no readiness blip: its restart is a cold start. No grace."""
    w = steady()
    [victim] = w.serving()
    [spare] = w.warm()
    w.crash(victim.name, died=True)
    p = w.plan(target())
    assert Relabel(spare.name, "serving", "Promoted") in p.actions
    assert DeletePod(victim.name, "FailedOver") in p.actions
    assert p.failovers == ((victim.name, spare.name, "Crashed"),)


def test_an_old_crash_does_not_skip_the_grace_of_a_later_hang():
    w = steady()
    [victim] = w.serving()
    from dataclasses import replace
    w.pods[victim.name] = replace(w.pods[victim.name], container_died_at=w.now - 100)
    w.hang(victim.name)
    assert not w.plan(target()).failovers


def test_a_crashed_serving_pod_is_covered_by_a_warm_pod_once_the_grace_has_passed():
    w = steady()
    [victim] = w.serving()
    [spare] = w.warm()
    w.crash(victim.name)
    crashed_at = w.now
    # Within the grace: only the gate closes, and the plan says when to look again.
    early = w.plan(target())
    assert [type(a).__name__ for a in early.actions] == ["SetWarmGate"]
    assert early.recheck_at == crashed_at + GRACE
    w.tick(GRACE)
    p = w.plan(target())
    assert Relabel(spare.name, "serving", "Promoted") in p.actions
    assert DeletePod(victim.name, "FailedOver") in p.actions
    assert CreatePod("warm", "PoolBackfill") in p.actions  # the pool refills behind it
    assert p.failovers == ((victim.name, spare.name, "CrashLoop"),)
    assert p.history.count == 1 and p.history.last == w.now


def test_a_hung_serving_pod_is_covered_too():
    w = steady()
    [victim] = w.serving()
    w.hang(victim.name)
    w.tick(GRACE)
    p = w.plan(target())
    assert DeletePod(victim.name, "FailedOver") in p.actions
    assert p.failovers[0][2] == "Unready"


def test_a_serving_pod_on_a_lost_node_is_covered():
    w = steady()
    [victim] = w.serving()
    w.tick(30)  # the gate opened long ago
    w.lose_node(victim.name)
    assert not w.plan(target()).failovers  # not yet: within the grace
    w.tick(GRACE)
    p = w.plan(target())
    assert p.failovers and p.failovers[0][:1] == (victim.name,) and p.failovers[0][2] == "NodeNotReady"


def test_a_pod_whose_gate_just_opened_is_not_taken_for_a_lost_one():
    """Ready is still False from before the gate opened: starting, not failing."""
    w = World()
    p = w.add("serving")
    w.tick(60)
    w.warm_up([p.name])
    w.step(target(1, 0))  # opens the gate; Ready in the sim follows at once
    from dataclasses import replace
    w.pods[p.name] = replace(w.pods[p.name], ready_condition="False", ready_changed=w.now - 50)
    w.tick(GRACE * 3)
    assert not w.plan(target(1, 0)).failovers


def test_an_unschedulable_serving_pod_is_covered():
    w = steady()
    [victim] = w.serving()
    w.unschedulable(victim.name)
    w.tick(GRACE)
    p = w.plan(target())
    assert p.failovers and p.failovers[0][2] == "Unschedulable"


def test_a_starting_serving_pod_makes_way_for_a_ready_warm_one_at_once():
    w = World()
    cold = w.add("serving")  # created cold: no warm pod was there
    spare = w.add("warm", ready=True)
    actions = w.plan(target()).actions
    assert actions == [Relabel(spare.name, "serving", "Promoted"),
                       Relabel(cold.name, "warm", "Demoted")]


def test_without_a_ready_warm_pod_the_pool_gets_a_replacement_and_nothing_is_deleted():
    w = steady(1, 0)
    [victim] = w.serving()
    w.crash(victim.name)
    w.tick(GRACE)
    p = w.plan(target(1, 0))
    assert not any(isinstance(a, DeletePod) for a in p.actions)
    assert CreatePod("warm", "PoolBackfill") in p.actions
    assert p.failing == (victim.name,)
    w.step(target(1, 0))
    # Once the replacement is warm, it takes over and the failing pod goes.
    [new] = w.warm()
    w.warm_up([new.name])
    p = w.plan(target(1, 0))
    assert Relabel(new.name, "serving", "Promoted") in p.actions
    assert DeletePod(victim.name, "FailedOver") in p.actions


def test_failover_never_promotes_an_outdated_warm_pod():
    w = steady()
    [victim] = w.serving()
    w.crash(victim.name)
    w.tick(GRACE)
    p = w.plan(target(hash="v2"))
    assert not any(isinstance(a, Relabel) and a.role == "serving" for a in p.actions)


def test_a_failing_warm_pod_is_replaced():
    w = steady()
    [spare] = w.warm()
    w.hang(spare.name)
    w.tick(GRACE)
    p = w.plan(target())
    assert DeletePod(spare.name, "FailedOver") in p.actions
    assert CreatePod("warm", "PoolBackfill") in p.actions


def test_a_warm_pod_that_never_got_warm_is_left_to_the_kubelet():
    """A new pod crash-looping in the pool (e.g. a broken template) is not deleted and
    recreated over and over: it was never warm, so it is starting, not failing."""
    w = World()
    w.add("serving", ready=True)
    bad = w.add("warm")
    w.crash(bad.name)
    w.tick(GRACE * 10)
    assert w.plan(target()).actions == []


def test_failovers_back_off_after_a_few():
    assert [failover_delay(n) for n in range(FREE_FAILOVERS + 3)] == \
        [0.0] * FREE_FAILOVERS + [BACKOFF_BASE_S, 2 * BACKOFF_BASE_S, 4 * BACKOFF_BASE_S]
    w = steady(1, 1)
    times = []
    for _ in range(FREE_FAILOVERS + 2):
        [victim] = w.serving()
        w.crash(victim.name)
        w.tick(GRACE)
        for _ in range(200):  # reconcile every second until the failover happens
            p = w.plan(target())
            if p.failovers:
                times.append(w.now)
                break
            if p.backoff_until is not None:
                assert p.recheck_at is not None and p.recheck_at <= p.backoff_until
            w.tick(1)
        w.step(target())
        w.warm_up()
        w.step(target())
    gaps = [b - a for a, b in zip(times, times[1:])]
    # The first ones come as fast as the crashes; then each waits longer.
    assert gaps[FREE_FAILOVERS - 1] >= BACKOFF_BASE_S
    assert gaps[FREE_FAILOVERS] >= 2 * BACKOFF_BASE_S


def test_the_streak_resets_after_a_quiet_while():
    h = FailoverHistory(count=10, last=1000.0)
    w = steady()
    [victim] = w.serving()
    w.now = 1000.0 + 10_000
    w.crash(victim.name)
    w.tick(GRACE)
    p = plan(target(), w.observed(), w.now, h)
    assert p.failovers and p.history.count == 1


def test_a_crash_looping_template_creates_a_bounded_number_of_pods():
    """Every new pod crashes right after start: no create/delete storm."""
    w = steady(2, 1)
    created = 0
    for _ in range(600):  # ten minutes, one reconcile a second
        actions = w.step(target(2, 1))
        created += sum(isinstance(a, CreatePod) for a in actions)
        for p in list(w.pods.values()):
            if p.containers_ready:
                w.crash(p.name)  # whatever gets warm dies again
            elif p.phase == "Pending":
                from dataclasses import replace
                w.pods[p.name] = replace(p, phase="Running")
                w.crash(p.name)
        w.tick(1)
    assert created <= 6, created


# -- draining ------------------------------------------------------------------------------------

def test_a_ready_serving_pod_leaves_the_endpoints_before_it_is_deleted():
    w = steady(2, 1)
    t = target(1, 1, drain_seconds=5)
    p = w.plan(t)
    [retire] = [a for a in p.actions if isinstance(a, Retire)]
    assert retire.reason == "ScaledDown"
    assert not any(isinstance(a, DeletePod) for a in p.actions)
    assert p.recheck_at == w.now + 5
    w.step(t)
    assert w.plan(t).actions == []  # still draining
    w.tick(5)
    assert w.plan(t).actions == [DeletePod(retire.pod, "Drained")]


def test_an_unready_serving_pod_is_deleted_without_draining():
    w = World()
    w.add("serving", ready=True)
    unready = w.add("serving")
    assert w.plan(target(1, 0, drain_seconds=5)).actions == [DeletePod(unready.name, "ScaledDown")]


# -- rollouts ------------------------------------------------------------------------------------

def test_a_rollout_replaces_the_pool_first_and_keeps_it_warm_while_serving_pods_move():
    w = steady(1, 1)
    [old_serving], [old_warm] = w.serving(), w.warm()
    t = target(1, 1, "v2", max_surge=1, drain_seconds=2)
    p = w.plan(t)
    # Outdated warm pods can never be promoted: they go at once; the surge starts new ones.
    assert DeletePod(old_warm.name, "RolledOut") in p.actions
    assert [a for a in p.actions if isinstance(a, CreatePod)] == [CreatePod("warm", "PoolBackfill")] * 2
    w.step(t)
    first, second = w.warm()
    w.warm_up([first.name])
    # One new pod is warm, the other still starting: the ready one stays in the pool.
    assert not any(isinstance(a, Relabel) for a in w.plan(t).actions)
    w.warm_up([second.name])
    # Its gate is not open yet: a planned swap waits until the Service would route to it.
    assert not any(isinstance(a, Relabel) for a in w.plan(t).actions)
    w.step(t)
    p = w.plan(t)
    assert Relabel(first.name, "serving", "Promoted") in p.actions
    assert Retire(old_serving.name, "RolledOut") in p.actions
    w.step(t)
    assert [x.name for x in w.warm(ready=True)] == [second.name]


def test_scale_up_during_a_rollout_never_promotes_an_outdated_pod():
    w = steady(1, 2)
    p = w.plan(target(3, 2, "v2"))
    assert not any(isinstance(a, Relabel) and a.role == "serving" for a in p.actions)
    assert sum(isinstance(a, CreatePod) and a.role == "serving" for a in p.actions) == 2


def test_max_unavailable_lets_serving_pods_go_before_their_replacement():
    w = steady(4, 0)
    t = target(4, 0, "v2", max_surge=0, max_unavailable=1)
    p = w.plan(t)
    assert sum(isinstance(a, DeletePod) and a.reason == "RolledOut" for a in p.actions) == 1
    assert p.actions.count(CreatePod("serving", "ScaledUp")) == 1


def _roll(w: World, t: Target, check) -> None:
    for _ in range(300):
        actions = w.step(t)
        check(w)
        if not actions and all(p.containers_ready for p in w.pods.values()) and \
                all(p.template_hash == t.template_hash for p in w.pods.values()) and \
                not any(p.role == "draining" for p in w.pods.values()):
            return
        # Pods warm one per round, the oldest first: some rounds see pods half-way.
        starting = sorted((p for p in w.pods.values() if not p.containers_ready
                           and p.role != "draining"), key=lambda p: p.created)
        w.warm_up([p.name for p in starting[:1]])
        w.tick(1)
    raise AssertionError(f"rollout did not finish: {w.pods}")


rollouts = st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 3), st.integers(0, 2),
                     st.sampled_from([0.0, 2.0]))


@settings(max_examples=EXAMPLES, deadline=None)
@given(rollouts)
def test_any_rollout_finishes_within_its_surge_and_unavailability_budget(case):
    replicas, pool, surge, unavailable, drain = case
    if pool == 0 and surge == 0 and unavailable == 0:
        surge = 1  # refused by the spec parser (spec.py): no progress possible
    w = steady(replicas, pool)
    t = target(replicas, pool, "v2", max_surge=surge, max_unavailable=unavailable,
               drain_seconds=drain)

    def check(w: World) -> None:
        live = [p for p in w.pods.values() if p.role != "draining"]
        assert len(live) <= replicas + pool + surge, live
        ready_serving = [p for p in w.serving() if p.containers_ready]
        assert len(ready_serving) >= replicas - unavailable, w.pods
        # Scale-up never promotes an outdated pod, and nor does anything else.
        assert not any(p.role == "serving" and p.template_hash == "v1" and not p.containers_ready
                       for p in w.pods.values())

    _roll(w, t, check)
    assert len(w.serving(ready=True)) == replicas and len(w.warm(ready=True)) == pool


# -- the planner as a whole -----------------------------------------------------------------------

pod_states = st.lists(
    st.tuples(st.sampled_from(["serving", "warm", "other", "draining"]), st.booleans(),
              st.sampled_from(["v1", "v0"]), st.sampled_from(["Running", "Pending", "Failed"]),
              st.sampled_from(["ok", "crash", "died", "hang", "node", "unschedulable"])),
    max_size=8,
)
targets = st.tuples(st.integers(0, 5), st.integers(0, 3), st.sampled_from(["v1", "v2"]),
                    st.integers(0, 2), st.integers(0, 2), st.sampled_from([0.0, 3.0]))


def _target(t) -> Target:
    replicas, pool, h, surge, unavailable, drain = t
    if pool == 0 and surge == 0 and unavailable == 0:
        surge = 1
    return Target(replicas, pool, h, max_surge=surge, max_unavailable=unavailable,
                  unready_seconds=GRACE, drain_seconds=drain)


def _world(pods) -> World:
    w = World()
    for role, ready, h, phase, fault in pods:
        p = w.add("serving" if role == "draining" else role,
                  ready=ready and phase == "Running", hash=h, phase=phase)
        if role == "draining":
            from dataclasses import replace
            w.pods[p.name] = replace(w.pods[p.name], role="draining", draining_since=w.now)
        elif fault in ("crash", "died") and phase == "Running":
            w.crash(p.name, died=fault == "died")
        elif fault == "hang" and phase == "Running":
            w.hang(p.name)
        elif fault == "node" and ready and phase == "Running":
            w.lose_node(p.name)
        elif fault == "unschedulable" and phase == "Pending":
            w.unschedulable(p.name)
    w.tick(GRACE + 1)
    return w


@settings(max_examples=EXAMPLES, deadline=None)
@given(pod_states, targets)
def test_any_world_reaches_a_fixed_point_after_one_application(pods, t):
    w = _world(pods)
    target = _target(t)
    first = w.plan(target)
    w.history = first.history
    w.apply(first.actions, target.template_hash)
    again = w.plan(target)
    assert again.actions == [], (first.actions, again.actions)


@settings(max_examples=EXAMPLES, deadline=None)
@given(pod_states, st.lists(targets, min_size=1, max_size=4))
def test_any_sequence_of_spec_changes_converges_to_the_last_spec(pods, sequence):
    w = _world(pods)
    for t in sequence:
        target = _target(t)
        # A few rounds under each intermediate spec, as if the user changed it mid-flight.
        for _ in range(2):
            w.step(target)
            w.warm_up()
            w.tick(1)
    # Faults heal (the kubelet restarts, the node returns): what is left must converge.
    from dataclasses import replace
    for name, p in list(w.pods.items()):
        w.pods[name] = replace(p, unschedulable_since=None, ready_condition="True")
    w.warm_up()
    settle(w, target)
    assert len(w.serving(ready=True)) == target.replicas
    assert len(w.warm(ready=True)) == target.warm_pool
    assert len(w.pods) == target.replicas + target.warm_pool
    assert {p.template_hash for p in w.pods.values()} <= {target.template_hash}
    assert all(p.gate for p in w.pods.values())


def test_desired_state_without_a_clock_never_fails_anything_over():
    w = steady()
    [victim] = w.serving()
    w.crash(victim.name)
    w.tick(1000)
    from preheat.operator.decide import desired_state
    assert not any(isinstance(a, DeletePod) for a in desired_state(target(), w.observed()))
