"""Autoscaling on engine load: the HorizontalPodAutoscaler's algorithm as a pure function.

Why the operator decides instead of an HPA: the signals that matter for LLM serving — queue
depth, running requests, KV-cache usage — are per-pod Prometheus gauges, which an HPA reads
only through a custom-metrics adapter that a fresh cluster does not have; CPU utilisation
means nothing on a GPU pod. So in `metric.type: Engine` mode the operator scrapes the gauges
of the Ready serving pods itself (scale_reconcile.py, scrape.py) and decides here exactly as an HPA with
the same target and behavior would, so that moving to the HPA route later (`Pods` or
`External` metrics) changes where the numbers come from, not how they are used.

What is mirrored from kubernetes/pkg/controller/podautoscaler:

- replica_calculator.go (calcPlainMetricReplicas): usage ratio = average over the pods that
  reported / target; |ratio - 1| <= tolerance (0.1) keeps the current count, else
  ceil(ratio * pods that reported). Pods that should have reported but did not ("missing":
  Ready, yet the scrape failed — e.g. dying mid-window) count as exactly the target on a
  scale-down (and at the target) and as 0 on a scale-up; serving pods that are not Ready
  are never scraped, and on a scale-up they count as 0 (capacity that is coming). If that correction flips the
  direction, or lands within the tolerance, the count stays.
- horizontal.go (stabilizeRecommendationWithBehaviors): every raw recommendation is kept
  with its time; a scale-up goes only as high as the lowest recommendation within
  scaleUpStabilizationSeconds, a scale-down only as low as the highest one within
  scaleDownStabilizationSeconds. A fresh history (operator start) is seeded with the
  current count, so a restart never scales down before a full down-window has been seen.
- replicas outside [min, max] are brought inside first; replicas 0 turns autoscaling off.

One rule is added: no scale-down while a serving pod is not Ready. The HPA reads a custom
metric from pods that are Running but not Ready; we never ask them (their numbers are not
what the Service routes to), so their load is unknown — and a serving pod is not Ready
either because it is starting (a scale-up under way) or because it is failing, often under
load (its probe timing out). Shrinking then would delete capacity, and the reconciler would
remove that very pod first. The failover of a pod that stays unready is the reconciler's job.

Not mirrored: the HPA's rate policies (by default +100% or +4 pods per 15 s up, -100% per
15 s down). Scale-up here is bounded by maxReplicas and by promotion from the warm pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The engine's per-pod gauges a service can scale on (engine/metrics.py; DESIGN.md contract).
ENGINE_METRICS = (
    "preheat_num_requests_waiting",
    "preheat_num_requests_running",
    "preheat_kv_cache_usage_ratio",
)
DEFAULT_TOLERANCE = 0.1  # kube-controller-manager --horizontal-pod-autoscaler-tolerance


@dataclass(frozen=True)
class Policy:
    metric: str
    target: float  # targetAverageValue, > 0
    min_replicas: int
    max_replicas: int
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    tolerance: float = DEFAULT_TOLERANCE


@dataclass(frozen=True)
class PodSample:
    """One serving pod in one scrape round."""
    name: str
    ready: bool  # the pod's Ready condition; not-Ready pods are not scraped
    value: float | None = None  # the gauge; None on a Ready pod: the scrape failed


@dataclass(frozen=True)
class Recommendation:
    at: float  # seconds, on the caller's monotonic clock
    replicas: int


@dataclass(frozen=True)
class Decision:
    desired: int
    current: int
    recommended: int | None  # the metric's raw recommendation; None when none was made
    average: float | None  # the gauge averaged over the pods that reported
    reporting: int  # pods whose gauge was read
    reason: str
    message: str
    history: tuple[Recommendation, ...]  # hand back to the next call

    @property
    def rescale(self) -> bool:
        return self.desired != self.current


def replicas_for_metric(samples: list[PodSample] | tuple[PodSample, ...], target: float,
                        current: int, tolerance: float = DEFAULT_TOLERANCE,
                        ) -> tuple[int, float] | None:
    """(recommended replicas, average) as the HPA computes them for a per-pod metric, or
    None when no pod reported (the HPA then makes no recommendation at all)."""
    metrics = {s.name: s.value for s in samples if s.ready and s.value is not None}
    if not metrics:
        return None
    missing = [s.name for s in samples if s.ready and s.value is None]
    unready = [s.name for s in samples if not s.ready]
    average = sum(metrics.values()) / len(metrics)
    ratio = average / target
    scale_up_with_unready = bool(unready) and ratio > 1.0
    if not scale_up_with_unready and not missing:
        if abs(1.0 - ratio) <= tolerance:
            return current, average
        return math.ceil(ratio * len(metrics)), average
    # Be conservative about what was not seen: it damps the move, never drives it.
    padded = dict(metrics)
    for name in missing:
        # At exactly the target the HPA's per-pod-metric rule counts a silent pod as 0 and
        # scales down; its resource-metric rule, followed here, leaves the count alone.
        padded[name] = target if ratio <= 1.0 else 0.0
    if scale_up_with_unready:
        for name in unready:
            padded[name] = 0.0
    new_ratio = sum(padded.values()) / len(padded) / target
    if abs(1.0 - new_ratio) <= tolerance or (ratio < 1.0 < new_ratio) or \
            (new_ratio < 1.0 < ratio):
        return current, average
    replicas = math.ceil(new_ratio * len(padded))
    if (new_ratio < 1.0 and replicas > current) or (new_ratio > 1.0 and replicas < current):
        return current, average
    return replicas, average


def stabilize(history: tuple[Recommendation, ...], recommended: int, current: int, now: float,
              up_window_s: float, down_window_s: float,
              ) -> tuple[int, tuple[Recommendation, ...]]:
    """The HPA's stabilization windows: returns (replicas, the history to keep)."""
    up = down = recommended
    for r in history:
        if r.at > now - up_window_s:
            up = min(up, r.replicas)
        if r.at > now - down_window_s:
            down = max(down, r.replicas)
    replicas = min(max(current, up), down)
    horizon = now - max(up_window_s, down_window_s)
    kept = tuple(r for r in history if r.at > horizon) + (Recommendation(now, recommended),)
    return replicas, kept


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def decide(policy: Policy, current: int, samples: list[PodSample] | tuple[PodSample, ...],
           history: tuple[Recommendation, ...] | None, now: float) -> Decision:
    """The replicas to set now. history is what the previous call returned (None on the
    first call of this operator for this service)."""
    if history is None:
        # As the HPA does when it first sees an autoscaler: the current count is a
        # recommendation, so a restarted operator waits out a full down-window.
        history = (Recommendation(now, current),) if policy.scale_down_window_s > 0 else ()
    reporting = sum(1 for s in samples if s.ready and s.value is not None)

    def done(desired: int, reason: str, message: str, recommended: int | None = None,
             average: float | None = None, kept: tuple[Recommendation, ...] = history,
             ) -> Decision:
        return Decision(desired, current, recommended, average, reporting, reason, message, kept)

    if current == 0:
        return done(0, "ScalingDisabled", "replicas is 0: autoscaling is off until it is raised")
    if current > policy.max_replicas:
        return done(policy.max_replicas, "AboveMaxReplicas",
                    f"replicas {current} is above maxReplicas {policy.max_replicas}")
    if current < policy.min_replicas:
        return done(policy.min_replicas, "BelowMinReplicas",
                    f"replicas {current} is below minReplicas {policy.min_replicas}")
    found = replicas_for_metric(samples, policy.target, current, policy.tolerance)
    if found is None:
        ready = sum(1 for s in samples if s.ready)
        return done(current, "NoMetrics",
                    f"no {policy.metric} from any of {ready} Ready serving pod(s); "
                    f"keeping {current}")
    recommended, average = found
    unready = sum(1 for s in samples if not s.ready)
    if recommended < current and unready:
        ready = len(samples) - unready
        return done(current, "UnreadyServingPods",
                    f"average {policy.metric} {_fmt(average)} over {reporting} Ready serving "
                    f"pod(s) recommends {recommended}, but {unready} serving pod(s) are not "
                    f"Ready ({ready} are): no scale-down while their load is unknown",
                    recommended=current, average=average,
                    kept=stabilize(history, current, current, now, policy.scale_up_window_s,
                                   policy.scale_down_window_s)[1])
    stabilized, kept = stabilize(history, recommended, current, now,
                                 policy.scale_up_window_s, policy.scale_down_window_s)
    desired = min(max(stabilized, policy.min_replicas), policy.max_replicas)
    seen = (f"average {policy.metric} {_fmt(average)} over {reporting} Ready serving pod(s), "
            f"target {_fmt(policy.target)}")
    limit = ""
    if stabilized > policy.max_replicas:
        limit = f", limited by maxReplicas {policy.max_replicas}"
    elif stabilized < policy.min_replicas:
        limit = f", limited by minReplicas {policy.min_replicas}"
    if desired > current:
        reason, why = "ScaleUp", f"{seen}: {recommended} recommended{limit}"
    elif desired < current:
        reason, why = "ScaleDown", f"{seen}: {recommended} recommended{limit}"
    elif recommended > current and stabilized == current:
        reason, why = "ScaleUpStabilized", (
            f"{seen}: {recommended} recommended, held at {current} by the lowest "
            f"recommendation of the last {_fmt(policy.scale_up_window_s)} s")
    elif recommended < current and stabilized == current:
        reason, why = "ScaleDownStabilized", (
            f"{seen}: {recommended} recommended, held at {current} by the highest "
            f"recommendation of the last {_fmt(policy.scale_down_window_s)} s")
    elif recommended > current:
        reason, why = "TooManyReplicas", f"{seen}: {recommended} recommended{limit}"
    elif recommended < current:
        reason, why = "TooFewReplicas", f"{seen}: {recommended} recommended{limit}"
    else:
        reason, why = "WithinTolerance", f"{seen}: {current} is right"
    return done(desired, reason, why, recommended, average, kept)


def status_of(decision: Decision, policy: Policy, last_scale_time: str | None) -> dict[str, object]:
    """status.autoscaling: the last decision, what it saw, and why."""
    out: dict[str, object] = {
        "metric": policy.metric,
        "targetAverageValue": policy.target,
        "reportingPods": decision.reporting,
        "currentReplicas": decision.current,
        "desiredReplicas": decision.desired,
        "reason": decision.reason,
        "message": decision.message,
    }
    if decision.average is not None:
        out["currentAverageValue"] = round(decision.average, 4)
    if decision.recommended is not None:
        out["recommendedReplicas"] = decision.recommended
    if last_scale_time:
        out["lastScaleTime"] = last_scale_time
    return out
