"""What the reconciler needs to know about one pod, read from its raw API object."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from preheat.operator.resources import (
    DRAINING_SINCE,
    LABEL_ROLE,
    LABEL_TEMPLATE_HASH,
    WARM_CONDITION,
)


def parse_time(text: str | None) -> float | None:
    """RFC 3339 (as the API server writes it) to epoch seconds; None when absent or bad."""
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class PodView:
    name: str
    role: str
    template_hash: str
    created: str  # RFC 3339; sorts chronologically as text
    phase: str = "Pending"  # Pending | Running | Succeeded | Failed | Unknown
    containers_ready: bool = False  # the kubelet's /ready probe passed: engine warm
    gate: bool = False  # our preheat.dev/warm condition on the pod
    terminating: bool = False
    # What failover needs (epoch seconds; None = unknown / not applicable):
    containers_ready_changed: float | None = None  # ContainersReady's lastTransitionTime
    ready_condition: str | None = None  # the pod's Ready condition: True/False/Unknown
    ready_changed: float | None = None  # Ready's lastTransitionTime
    unschedulable_since: float | None = None  # PodScheduled=False, reason Unschedulable
    unschedulable_message: str = ""
    was_warm: bool = False  # the operator has opened the warm gate on it before
    gate_changed: float | None = None  # the warm gate's lastTransitionTime
    restarts: int = 0
    container_died_at: float | None = None  # the last container exit the kubelet reported
    draining_since: float | None = None  # role=draining: out of the endpoints since then
    # What the engine wrote to its terminationMessagePath when it last exited (the kubelet
    # copies it into state/lastState.terminated.message), e.g. "ModelUnavailable: ...".
    termination_message: str = ""

    @property
    def dead(self) -> bool:
        return self.phase in ("Failed", "Succeeded")


def _conditions(pod: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c.get("type"): c for c in (pod.get("status") or {}).get("conditions") or []}


def _died_at(status: Mapping[str, Any]) -> float | None:
    """The newest finishedAt of a terminated container (its state, or the last state of one
    that was restarted)."""
    times = []
    for c in status.get("containerStatuses") or []:
        for where in (c.get("state") or {}, c.get("lastState") or {}):
            t = parse_time((where.get("terminated") or {}).get("finishedAt"))
            if t is not None:
                times.append(t)
    return max(times) if times else None


def _termination_message(status: Mapping[str, Any]) -> str:
    """The message of the newest container exit (state, else lastState)."""
    newest: tuple[float, str] = (-1.0, "")
    for c in status.get("containerStatuses") or []:
        for where in (c.get("state") or {}, c.get("lastState") or {}):
            t = where.get("terminated") or {}
            if t.get("message"):
                newest = max(newest, (parse_time(t.get("finishedAt")) or 0.0, str(t["message"])))
    return newest[1]


def view(pod: Mapping[str, Any]) -> PodView:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = pod.get("status") or {}
    conds = _conditions(pod)
    true = lambda t: (conds.get(t) or {}).get("status") == "True"  # noqa: E731
    changed = lambda t: parse_time((conds.get(t) or {}).get("lastTransitionTime"))  # noqa: E731
    scheduled = conds.get("PodScheduled") or {}
    unschedulable = scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable"
    return PodView(
        name=meta["name"],
        role=labels.get(LABEL_ROLE, ""),
        template_hash=labels.get(LABEL_TEMPLATE_HASH, ""),
        created=meta.get("creationTimestamp") or "",
        phase=status.get("phase") or "Pending",
        containers_ready=true("ContainersReady"),
        gate=true(WARM_CONDITION),
        terminating=bool(meta.get("deletionTimestamp")),
        containers_ready_changed=changed("ContainersReady"),
        ready_condition=(conds.get("Ready") or {}).get("status"),
        ready_changed=changed("Ready"),
        unschedulable_since=(
            (parse_time(scheduled.get("lastTransitionTime")) or parse_time(meta.get("creationTimestamp")))
            if unschedulable else None),
        unschedulable_message=str(scheduled.get("message") or "") if unschedulable else "",
        was_warm=WARM_CONDITION in conds,
        gate_changed=changed(WARM_CONDITION),
        restarts=sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or []),
        container_died_at=_died_at(status),
        draining_since=parse_time((meta.get("annotations") or {}).get(DRAINING_SINCE)),
        termination_message=_termination_message(status),
    )
