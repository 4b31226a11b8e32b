"""One pass of the built-in (metric.type Engine) autoscaler for one InferenceService.

The thin, effectful shell around scale_decide.decide(): read the resource and its serving pods,
scrape the gauge from the Ready ones (scrape.py), decide, and when the count changes set
spec.replicas through the /scale subresource — the same door `kubectl scale` and an HPA
use, so all of them see one number — then record the decision in status.autoscaling and as
an Event. It runs in its own kopf daemon per service (handlers.py), so a slow scrape never
delays a reconcile, of this service or any other.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from preheat.operator.kube import Kube
from preheat.operator.pods import view
from preheat.operator.quantity import parse_quantity
from preheat.operator.resources import (
    INFERENCE_SERVICES,
    LABEL_ROLE,
    LABEL_SERVICE,
    PODS,
    ROLE_SERVING,
)
from preheat.operator.scale_decide import (
    Decision,
    PodSample,
    Policy,
    Recommendation,
    decide,
    status_of,
)
from preheat.operator.scrape import metrics_url, scrape
from preheat.operator.spec import SpecError, parse_spec

log = logging.getLogger(__name__)
EventSink = Callable[[Mapping[str, Any], str, str, str], None]
# Receives one JSON-able record per pass (--autoscale-log): what was seen and decided.
RoundSink = Callable[[dict[str, Any]], None]


@dataclass
class AutoscalerMemory:
    """What one service's autoscaler keeps between passes (in memory, like the HPA: a
    restarted operator starts with None and waits out a full scale-down window)."""
    history: tuple[Recommendation, ...] | None = None
    last_reason: str | None = None


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _owned(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid for r in refs)


def round_record(namespace: str, name: str, now: float, fresh: bool, policy: Policy,
                 current: int, samples: list[PodSample], decision: Decision) -> dict[str, Any]:
    """One pass as data: enough to replay it through decide() (tests/operator replays
    recorded runs) and to answer "why did it scale?" after the fact."""
    return {"service": f"{namespace}/{name}", "t": round(now, 3), "fresh": fresh,
            "policy": {"metric": policy.metric, "target": policy.target,
                       "min_replicas": policy.min_replicas, "max_replicas": policy.max_replicas,
                       "scale_up_window_s": policy.scale_up_window_s,
                       "scale_down_window_s": policy.scale_down_window_s},
            "current": current,
            "samples": [{"name": s.name, "ready": s.ready, "value": s.value} for s in samples],
            "desired": decision.desired, "recommended": decision.recommended,
            "reason": decision.reason}


def policy_of(body: Mapping[str, Any]) -> Policy | None:
    """The Engine-mode policy of a resource, or None (no autoscaling, another mode, or a
    spec the reconciler reports as Degraded)."""
    try:
        spec = parse_spec(body.get("spec") or {})
    except SpecError:
        return None
    auto = spec.autoscaling
    if auto is None or not auto.engine_mode:
        return None
    return Policy(metric=auto.metric.name,
                  target=parse_quantity(auto.metric.target_average_value or "0"),
                  min_replicas=auto.min_replicas, max_replicas=auto.max_replicas,
                  scale_up_window_s=auto.scale_up_stabilization_seconds,
                  scale_down_window_s=auto.scale_down_stabilization_seconds)


async def autoscale(kube: Kube, http: httpx.AsyncClient, namespace: str, name: str,
                    memory: AutoscalerMemory, events: EventSink, *, scrape_timeout: float,
                    clock: Callable[[], float] = time.monotonic,
                    record: RoundSink | None = None,
                    logger: logging.Logger | logging.LoggerAdapter = log,
                    ) -> Decision | None:
    """One pass; returns the decision (None when the service is gone or not in Engine mode)."""
    body = await kube.get(INFERENCE_SERVICES, namespace, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    policy = policy_of(body)
    if policy is None:
        memory.history = None
        return None
    uid = body["metadata"]["uid"]
    selector = {LABEL_SERVICE: name, LABEL_ROLE: ROLE_SERVING}
    raw = [p for p in await kube.list(PODS, namespace, selector) if _owned(p, uid)]
    pods = [(view(p), p) for p in raw]
    serving = [(v, p) for v, p in pods
               if v.role == ROLE_SERVING and not v.terminating and not v.dead]
    # Only Ready serving pods are asked: the Service sends them traffic, warm pods take none,
    # and a pod that is not Ready has nothing to say about load it does not get.
    ready = {v.name: metrics_url(p) for v, p in serving if v.containers_ready and v.gate}
    urls = {n: u for n, u in ready.items() if u}
    values = await scrape(http, urls, policy.metric, scrape_timeout)
    samples = [PodSample(v.name, v.name in ready, values.get(v.name)) for v, _ in serving]
    current = int((body.get("spec") or {}).get("replicas", 1))
    now = clock()
    decision = decide(policy, current, samples, memory.history, now)
    if record is not None:
        record(round_record(namespace, name, now, memory.history is None, policy, current,
                            samples, decision))
    memory.history = decision.history

    previous = (body.get("status") or {}).get("autoscaling") or {}
    last_scale = previous.get("lastScaleTime")
    if decision.rescale:
        await kube.patch(INFERENCE_SERVICES, namespace, name,
                         {"spec": {"replicas": decision.desired}}, subresource="scale")
        last_scale = _now_iso()
        events(body, "Normal", "SuccessfulRescale",
               f"New size: {decision.desired}; reason: {decision.message}")
        logger.info(f"scaled {current} -> {decision.desired}: {decision.message}")
    elif decision.reason == "NoMetrics" and memory.last_reason != "NoMetrics":
        events(body, "Warning", "FailedGetEngineMetrics", decision.message)
    memory.last_reason = decision.reason

    status = status_of(decision, policy, last_scale)
    if status != previous:
        # A merge patch: keys the new decision lacks must be removed explicitly.
        patch: dict[str, Any] = {k: None for k in previous if k not in status}
        patch.update(status)
        await kube.patch(INFERENCE_SERVICES, namespace, name,
                         {"status": {"autoscaling": patch}}, subresource="status")
    return decision
