"""Whether an object the operator wants to manage is its own to change: a pure decision.

The operator creates its children (Service, PersistentVolumeClaim, HorizontalPodAutoscaler,
PodDisruptionBudget) under fixed names. An object of that name that someone else made — a
hand-written Service, another tool's HPA, a claim holding someone's data — must never be
patched into ours: the operator would silently take over (or break) what it routes, scales
or stores. So it is left untouched and reported as a conflict (a Degraded condition and an
Event naming it) until its owner renames or deletes it.

Ours means: an owner reference to this InferenceService (its uid). One exception, the
snapshot claim kept by `snapshot.retainOnDelete`: it carries no owner reference by design,
so a claim with our service label and no other controller is ours to adopt (that is what
retainOnDelete is for: a service re-created under the same name finds its snapshots again).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from preheat.operator.resources import LABEL_SERVICE


class Ownership(Enum):
    ABSENT = "absent"  # nothing of that name: create it
    OURS = "ours"  # our owner reference: keep it in step with the spec
    ADOPTABLE = "adoptable"  # a retained snapshot claim of this service's name
    FOREIGN = "foreign"  # someone else's: leave it alone, report a conflict


@dataclass(frozen=True)
class Conflict:
    kind: str  # Service, PersistentVolumeClaim, HorizontalPodAutoscaler, PodDisruptionBudget
    name: str
    reason: str  # the Degraded condition's and the Event's reason, e.g. ServiceConflict
    message: str
    # Whether new pods must wait: a pod would mount a foreign claim (its data, our writes).
    # The other conflicts cost a feature (routing, autoscaling, a budget), not safety.
    blocks_pods: bool


# kind -> (reason, blocks new pods)
_CONFLICTS = {
    "Service": ("ServiceConflict", False),
    "PersistentVolumeClaim": ("PVCConflict", True),
    "HorizontalPodAutoscaler": ("HPAConflict", False),
    "PodDisruptionBudget": ("PDBConflict", False),
    "NetworkPolicy": ("NetworkPolicyConflict", False),
}


def _refs(obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list((obj.get("metadata") or {}).get("ownerReferences") or [])


def ownership(obj: Mapping[str, Any] | None, service: str, uid: str, *,
              adopt_retained: bool = False) -> Ownership:
    """How `obj` (as read from the API, or None) stands to the InferenceService `service`
    with `uid`. adopt_retained: the snapshot claim, which retainOnDelete leaves unowned."""
    if obj is None:
        return Ownership.ABSENT
    refs = _refs(obj)
    if any(r.get("uid") == uid for r in refs):
        return Ownership.OURS
    labels = (obj.get("metadata") or {}).get("labels") or {}
    if adopt_retained and labels.get(LABEL_SERVICE) == service and \
            not any(r.get("controller") for r in refs):
        return Ownership.ADOPTABLE
    return Ownership.FOREIGN


def _owner_words(obj: Mapping[str, Any]) -> str:
    controller = next((r for r in _refs(obj) if r.get("controller")), None) or \
        next(iter(_refs(obj)), None)
    if controller is None:
        return "it has no owner reference"
    return f"it belongs to {controller.get('kind', '?')} {controller.get('name', '?')!r}"


def conflict(kind: str, obj: Mapping[str, Any], service: str) -> Conflict:
    """The conflict to report for a FOREIGN object `obj` of `kind` (see ownership())."""
    reason, blocks = _CONFLICTS[kind]
    name = (obj.get("metadata") or {}).get("name", "?")
    consequence = "no new pods until it is gone (they would mount it)" if blocks else \
        "the operator does not manage it"
    return Conflict(kind, name, reason,
                    f"{kind} {name!r} already exists and is not owned by InferenceService "
                    f"{service!r} ({_owner_words(obj)}); left untouched, {consequence}: "
                    f"rename or delete it", blocks)
