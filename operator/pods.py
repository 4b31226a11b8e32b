"""What the reconciler needs to know about one pod, read from its raw API object."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from preheat.operator.resources import LABEL_ROLE, LABEL_TEMPLATE_HASH, WARM_CONDITION


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

    @property
    def dead(self) -> bool:
        return self.phase in ("Failed", "Succeeded")


def _condition(pod: Mapping[str, Any], ctype: str) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return cond.get("status") == "True"
    return False


def view(pod: Mapping[str, Any]) -> PodView:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    return PodView(
        name=meta["name"],
        role=labels.get(LABEL_ROLE, ""),
        template_hash=labels.get(LABEL_TEMPLATE_HASH, ""),
        created=meta.get("creationTimestamp") or "",
        phase=(pod.get("status") or {}).get("phase") or "Pending",
        containers_ready=_condition(pod, "ContainersReady"),
        gate=_condition(pod, WARM_CONDITION),
        terminating=bool(meta.get("deletionTimestamp")),
    )
