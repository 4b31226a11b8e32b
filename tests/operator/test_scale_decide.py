"""The built-in autoscaler's decision (preheat.operator.scale_decide): no cluster, no model.

Three kinds of evidence: single rounds checked against the Kubernetes HPA's own test vectors
(kubernetes/pkg/controller/podautoscaler/replica_calculator_test.go), metric series played
through decide() round by round as the operator would (bursts, flapping, pods dying
mid-window, an operator restart), and properties over random series.
"""

from __future__ import annotations

import json
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from preheat.operator.scale_decide import (
    Decision,
    PodSample,
    Policy,
    Recommendation,
    decide,
    replicas_for_metric,
    stabilize,
    status_of,
)

SERIES_DIR = pathlib.Path(__file__).parent / "fixtures" / "autoscale"


def ready(*values: float | None) -> list[PodSample]:
    return [PodSample(f"p{i}", True, v) for i, v in enumerate(values)]


def pods(spec: str, values: list[float | None]) -> list[PodSample]:
    """spec: one letter per pod, R = Ready, U = not Ready; values fill the Ready pods."""
    out, it = [], iter(values)
    for i, c in enumerate(spec):
        out.append(PodSample(f"p{i}", True, next(it)) if c == "R" else PodSample(f"p{i}", False))
    return out


# (name in replica_calculator_test.go, current, samples, target, expected replicas). Values in
# the Go tests are milli-units; CPU cases with 1.0-core requests read the same as a per-pod
# value against target = request * utilization. Only cases whose rules are the same for a
# per-pod metric are taken: the HPA reads custom metrics of pods that are not Ready, which
# this autoscaler never does (issue 19: "pods that are not Ready never count").
HPA_VECTORS = [
    ("TestReplicaCalcScaleUpCM", 3, ready(20000, 10000, 30000), 15000, 4),
    ("TestReplicaCalcToleranceCM", 3, ready(20000, 21000, 21000), 20000, 3),
    ("TestReplicaCalcScaleDownCM", 5, ready(*[12000] * 5), 20000, 3),
    ("TestReplicaCalcScaleUpCMExternalNoLabels", 1, ready(8600), 4400, 2),
    ("TestReplicaCalcScaleUp", 3, ready(300, 500, 700), 300, 5),
    ("TestReplicaCalcScaleUpUnreadyLessScale", 3, pods("URR", [500, 700]), 300, 4),
    ("TestReplicaCalcScaleUpUnreadyNoScale", 3, pods("RUU", [400]), 300, 3),
    ("TestReplicaCalcScaleDownIncludeUnreadyPods", 5, pods("RRRUU", [100, 300, 500]), 500, 2),
    ("TestReplicaCalcScaleDownExcludeUnscheduledPods", 5, pods("RUUUU", [100]), 500, 1),
    ("TestReplicaCalcMissingMetricsNoChangeGt", 2, ready(1900, None), 1000, 2),
    ("TestReplicaCalcMissingMetricsNoChangeLt", 2, ready(600, None), 1000, 2),
    ("TestReplicaCalcMissingMetricsUnreadyChange", 3, pods("URR", [450, None]), 500, 3),
    ("TestReplicaCalcMissingMetricsUnreadyScaleUp", 3, pods("URR", [2000, None]), 500, 4),
    ("TestReplicaCalcDuringRollingUpdateWithMaxSurge", 2, ready(100, 100, None), 500, 2),
]


@pytest.mark.parametrize("name,current,samples,target,expected", HPA_VECTORS,
                         ids=[v[0] for v in HPA_VECTORS])
def test_one_round_matches_the_hpa_replica_calculator(name, current, samples, target, expected):
    replicas, _ = replicas_for_metric(samples, target, current)
    assert replicas == expected


def test_a_missing_pod_at_exactly_the_target_changes_nothing():
    # One pod at the target, one that did not answer: the HPA's per-pod-metric rule would
    # count the silent one as 0 and halve the service; we count it as the target (its
    # resource-metric rule does the same), so an unanswered scrape never drives a change.
    assert replicas_for_metric(ready(4.0, None), 4.0, 2) == (2, 4.0)


def test_no_reporting_pod_means_no_recommendation_and_no_change():
    policy = Policy("preheat_num_requests_waiting", 2.0, 1, 5)
    d = decide(policy, 3, [PodSample("a", True, None), PodSample("b", False)], (), now=100.0)
    assert (d.desired, d.reason, d.recommended, d.average) == (3, "NoMetrics", None, None)
    assert d.history == ()  # nothing was recommended, nothing is remembered


def test_bounds_come_first_and_zero_replicas_turns_autoscaling_off():
    policy = Policy("preheat_num_requests_running", 4.0, 2, 5)
    busy = ready(100.0)
    assert decide(policy, 0, busy, (), 0.0).reason == "ScalingDisabled"
    assert decide(policy, 0, busy, (), 0.0).desired == 0
    assert (decide(policy, 1, busy, (), 0.0).desired, decide(policy, 1, busy, (), 0.0).reason) == \
        (2, "BelowMinReplicas")
    assert (decide(policy, 9, [], (), 0.0).desired, decide(policy, 9, [], (), 0.0).reason) == \
        (5, "AboveMaxReplicas")
    # Within bounds: a recommendation above max is cut to max, below min raised to min.
    up = decide(policy, 3, ready(40.0, 40.0, 40.0), (), 0.0)
    assert (up.recommended, up.desired, up.reason) == (30, 5, "ScaleUp")
    assert "limited by maxReplicas 5" in up.message
    down = decide(Policy("preheat_num_requests_running", 4.0, 2, 5, scale_down_window_s=0),
                  3, ready(0.0, 0.0, 0.0), (), 0.0)
    assert (down.recommended, down.desired, down.reason) == (0, 2, "ScaleDown")


def test_stabilization_takes_the_min_over_the_up_window_and_the_max_over_the_down_window():
    history = (Recommendation(0.0, 6), Recommendation(50.0, 2), Recommendation(90.0, 4))
    # Down-window 60 s at t=100: recommendations at 50 and 90 count; max(2, 4, new 1) = 4.
    assert stabilize(history, 1, 5, 100.0, 0.0, 60.0)[0] == 4
    # Up-window 60 s: min(2, 4, new 8) = 2 -> stays at the current 3.
    assert stabilize(history, 8, 3, 100.0, 60.0, 0.0)[0] == 3
    # Without windows the raw recommendation goes through, and only the new one is kept.
    replicas, kept = stabilize(history, 8, 3, 100.0, 0.0, 0.0)
    assert replicas == 8 and kept == (Recommendation(100.0, 8),)
    # Entries older than both windows are dropped.
    assert stabilize(history, 1, 5, 100.0, 10.0, 60.0)[1] == (
        Recommendation(50.0, 2), Recommendation(90.0, 4), Recommendation(100.0, 1))


# -- series: the operator's loop, round by round ---------------------------------------------

def play(policy: Policy, rounds: list[tuple[float, list[PodSample]]], replicas: int,
         history: tuple[Recommendation, ...] | None = None) -> list[Decision]:
    """Feeds the rounds to decide() the way scale_reconcile.py does: the desired count is
    applied (spec.replicas) before the next round; history is carried over."""
    out = []
    for now, samples in rounds:
        d = decide(policy, replicas, samples, history, now)
        history, replicas = d.history, d.desired
        out.append(d)
    return out


WAITING = Policy("preheat_num_requests_waiting", target=2.0, min_replicas=1, max_replicas=4,
                 scale_up_window_s=0, scale_down_window_s=60)


def test_a_burst_scales_up_at_once_and_down_only_after_the_down_window():
    # 15 s rounds. Load arrives at t=30 on the one serving pod, spreads as pods join, and
    # ends at t=90.
    rounds = [(0, ready(0.0)), (15, ready(0.0)), (30, ready(9.0)),
              (45, ready(3.0, 3.0, 3.0, 3.0)), (60, ready(2.0, 2.0, 2.0, 2.0)),
              (75, ready(2.0, 2.0, 2.0, 2.0)), (90, ready(0.0, 0.0, 0.0, 0.0))]
    rounds += [(t, ready(*[0.0] * 4)) for t in range(105, 181, 15)]
    ds = play(WAITING, rounds, replicas=1)
    desired = [d.desired for d in ds]
    assert desired[:3] == [1, 1, 4]  # 9/2 -> ceil(4.5) = 5, held at maxReplicas 4
    assert ds[2].reason == "ScaleUp" and ds[2].average == 9.0
    # After t=90 the recommendation is 1, but 4 was recommended within the last 60 s
    # until t=75 + 60: held, and the reason says so.
    held = [d for t, d in zip([r[0] for r in rounds], ds) if 90 <= t < 135]
    assert held and all(d.desired == 4 and d.reason == "ScaleDownStabilized" for d in held)
    first_down = next(t for (t, _), d in zip(rounds, ds) if t >= 90 and d.desired < 4)
    assert first_down == 135 and desired[-1] == 1


def test_flapping_load_never_scales_down_within_the_window():
    # The queue alternates between busy and idle every 15 s: a down-window longer than the
    # idle spells keeps the capacity, so there is one scale-up and no scale-down at all.
    rounds = [(t, ready(*([6.0] if (t // 15) % 2 == 0 else [0.0]) * 3)) for t in range(0, 600, 15)]
    ds = play(WAITING, rounds, replicas=3)
    changes = [(d.current, d.desired) for d in ds if d.rescale]
    assert changes == [(3, 4)]
    assert all(d.desired == 4 for d in ds[1:])
    # Without a down-window the same series flaps on every round.
    no_window = Policy(**{**WAITING.__dict__, "scale_down_window_s": 0})
    flaps = [d for d in play(no_window, rounds, replicas=3) if d.rescale]
    assert len(flaps) > 30


def test_a_scale_up_window_ignores_a_single_spike():
    policy = Policy("preheat_num_requests_waiting", 2.0, 1, 4, scale_up_window_s=30,
                    scale_down_window_s=0)
    spike = [(0, ready(0.0)), (10, ready(0.0)), (20, ready(8.0)), (30, ready(0.0)),
             (40, ready(0.0))]
    assert all(d.desired == 1 for d in play(policy, spike, replicas=1))
    # Load that stays over the whole up-window does scale up, once the window has seen it.
    sustained = [(0, ready(0.0))] + [(t, ready(8.0)) for t in range(10, 60, 10)]
    ds = play(policy, sustained, replicas=1)
    first_up = next(t for (t, _), d in zip(sustained, ds) if d.desired > 1)
    assert first_up == 30 and ds[2].reason == "ScaleUpStabilized"


def test_pods_dying_mid_window_never_drive_a_scale_down_or_an_overshoot():
    # Three busy pods; two stop answering their scrape (dying, their node gone) while the
    # one left is at the target. Counting the silent pods as idle would halve the service;
    # as the HPA does, they count as at-target on a scale-down -> no change.
    policy = Policy("preheat_num_requests_running", 4.0, 1, 6, scale_down_window_s=0)
    rounds = [(0, ready(4.0, 4.0, 4.0)), (15, ready(4.0, None, None)), (30, ready(3.0, None, None))]
    ds = play(policy, rounds, replicas=3)
    assert [d.desired for d in ds] == [3, 3, 3]
    # On a scale-up the silent pods count as 0: 12/4 = 3x over 1 pod would mean 9 pods;
    # with two silent ones it is ceil(12/3/4 * 3) = 3 -> no overshoot while they are gone.
    assert decide(policy, 3, ready(12.0, None, None), (), 0.0).desired == 3
    # A dying pod that is already not Ready is not asked, and on a scale-up it counts as
    # 0 (capacity that may come back), exactly as a starting pod does.
    assert decide(policy, 2, [PodSample("a", True, 12.0), PodSample("b", False)], (), 0.0).desired == 3


def test_no_scale_down_while_a_serving_pod_is_not_ready():
    # Seen on the 2-core harness: the one serving pod, overloaded, fails its readiness probe;
    # the cold pod just added becomes Ready and idle. Longer than the down-window passes
    # with no Ready pod reporting (no recommendations), then the only reading is the idle
    # new pod: the HPA's rules alone would scale down — and the reconciler would delete the
    # unready, busy pod first. The load of a pod that is not Ready is unknown: hold.
    policy = Policy("preheat_num_requests_running", 4.0, 1, 2, scale_down_window_s=20)
    rounds = [(0, ready(8.0))]  # -> 2
    rounds += [(t, [PodSample("busy", False), PodSample("new", False)]) for t in range(5, 40, 5)]
    rounds += [(t, [PodSample("busy", False), PodSample("new", True, 0.0)]) for t in range(40, 80, 5)]
    ds = play(policy, rounds, replicas=1)
    assert [d.desired for d in ds] == [2] * len(ds)
    assert {d.reason for d in ds[1:8]} == {"NoMetrics"}
    assert {d.reason for d in ds[8:]} == {"UnreadyServingPods"}
    assert "1 serving pod(s) are not Ready" in ds[-1].message
    # Once it is Ready again and idle, the scale-down goes ahead (after the window).
    after = play(policy, [(t, ready(0.0, 0.0)) for t in range(80, 120, 5)], replicas=2,
                 history=ds[-1].history)
    assert after[-1].desired == 1
    # A scale-up is never held by an unready pod (it counts as 0, as in the HPA).
    assert decide(policy, 1, [PodSample("a", True, 12.0), PodSample("b", False)], (), 0).desired == 2


def test_a_restarted_operator_waits_a_full_down_window_before_scaling_down():
    # No history (a new operator process): the current count is seeded as a recommendation.
    policy = Policy("preheat_num_requests_waiting", 2.0, 1, 4, scale_down_window_s=60)
    rounds = [(t, ready(0.0, 0.0, 0.0)) for t in range(1000, 1100, 15)]
    ds = play(policy, rounds, replicas=3, history=None)
    assert [d.desired for d in ds if d.rescale] == [1]
    # The first round at which the seed (t=1000) has left the 60 s window.
    assert next(t for (t, _), d in zip(rounds, ds) if d.rescale) == 1060
    # A scale-up is not held back by the seed.
    assert decide(policy, 1, ready(9.0), None, 5.0).desired == 4


def test_status_carries_the_decision():
    policy = Policy("preheat_num_requests_waiting", 2.0, 1, 4)
    d = decide(policy, 1, ready(6.0), (), 0.0)
    st = status_of(d, policy, "2026-01-01T00:00:00Z")
    assert st == {"metric": "preheat_num_requests_waiting", "targetAverageValue": 2.0,
                  "reportingPods": 1, "currentReplicas": 1, "desiredReplicas": 3,
                  "recommendedReplicas": 3, "currentAverageValue": 6.0, "reason": "ScaleUp",
                  "message": d.message, "lastScaleTime": "2026-01-01T00:00:00Z"}
    assert "average preheat_num_requests_waiting 6 over 1 Ready serving pod(s), target 2" in d.message
    none = status_of(decide(policy, 1, [PodSample("a", True, None)], (), 0.0), policy, None)
    assert "currentAverageValue" not in none and none["reason"] == "NoMetrics"


# -- a series recorded on the local harness ----------------------------------------------------

def recorded_series() -> list[pathlib.Path]:
    return sorted(SERIES_DIR.glob("*.json"))


def test_there_is_a_recorded_series():
    assert recorded_series()


@pytest.mark.parametrize("path", recorded_series(), ids=lambda p: p.stem)
def test_replaying_a_recorded_series_reproduces_the_operators_decisions(path):
    """benchmarks/autoscale.py --record writes every round the operator saw on the local
    harness (time, per-pod samples) and what it decided; replayed through decide() from
    the same start, the same decisions come out."""
    rec = json.loads(path.read_text())
    p = rec["policy"]
    policy = Policy(p["metric"], p["target"], p["min_replicas"], p["max_replicas"],
                    p["scale_up_window_s"], p["scale_down_window_s"])
    history = None
    for r in rec["rounds"]:
        samples = [PodSample(s["name"], s["ready"], s["value"]) for s in r["samples"]]
        d = decide(policy, r["current"], samples, history, r["t"])
        history = d.history
        assert (d.desired, d.reason) == (r["desired"], r["reason"]), r
    # The series holds a real scale-up and the scale-down after it.
    reasons = [r["reason"] for r in rec["rounds"]]
    assert "ScaleUp" in reasons and "ScaleDown" in reasons


# -- properties ------------------------------------------------------------------------------

values = st.one_of(st.none(), st.floats(0, 50, allow_nan=False))


@st.composite
def rounds_st(draw):
    """A round in the steady state: as many serving pods as spec.replicas, each Ready or
    not, each Ready one reporting a value or silent."""
    current = draw(st.integers(1, 8))
    raw = draw(st.lists(st.tuples(st.booleans(), values), min_size=current, max_size=current))
    return current, [PodSample(f"p{i}", r, v) for i, (r, v) in enumerate(raw)]


@settings(max_examples=int(__import__("os").environ.get("PREHEAT_HYPOTHESIS_EXAMPLES", 150)),
          deadline=None)
@given(rounds_st(), st.floats(0.5, 10), st.integers(1, 3), st.integers(3, 10))
def test_any_round_stays_within_bounds_and_a_silent_pod_never_drives_the_direction(
        round_, target, lo, hi):
    current, samples = round_
    policy = Policy("preheat_num_requests_running", target, lo, hi, 0, 0)
    d = decide(policy, current, samples, (), 0.0)
    assert lo <= d.desired <= hi
    found = replicas_for_metric(samples, target, current)
    if found is None:
        assert d.reason in ("NoMetrics", "BelowMinReplicas", "AboveMaxReplicas")
        return
    replicas, average = found
    # Whatever was not seen, the direction of a change is the one the reporting pods ask for.
    if replicas > current:
        assert average > target
    if replicas < current:
        assert average < target


@settings(max_examples=int(__import__("os").environ.get("PREHEAT_HYPOTHESIS_EXAMPLES", 150)),
          deadline=None)
@given(st.lists(st.integers(1, 10), min_size=1, max_size=30), st.integers(1, 10),
       st.sampled_from([0, 15, 60]), st.sampled_from([0, 15, 60]))
def test_stabilized_replicas_stay_between_the_window_extremes(recs, current, up, down):
    history: tuple[Recommendation, ...] = ()
    for i, r in enumerate(recs):
        now = 5.0 * i
        replicas, history = stabilize(history, r, current, now, up, down)
        in_up = [h.replicas for h in history if h.at > now - up] or [r]
        in_down = [h.replicas for h in history if h.at > now - down] or [r]
        if replicas > current:
            assert replicas == min(in_up + [r])
        if replicas < current:
            assert replicas == max(in_down + [r])
        current = replicas
