"""The InferenceService status as a pure function of what was observed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from preheat.operator.pods import PodView
from preheat.operator.resources import ROLE_SERVING, ROLE_WARM


@dataclass(frozen=True)
class Observation:
    replicas: int  # spec.replicas
    warm_pool: int
    template_hash: str
    pods: tuple[PodView, ...]
    snapshot_enabled: bool
    snapshot_phase: str | None  # the PVC's status.phase, None when absent
    degraded: tuple[str, str] | None  # (reason, message)
    generation: int | None


def _live(obs: Observation, role: str) -> list[PodView]:
    return [p for p in obs.pods if p.role == role and not p.terminating and not p.dead]


def _cond(ctype: str, ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": ctype, "status": "True" if ok else "False", "reason": reason,
            "message": message}


def compute(obs: Observation, selector: str, previous: Mapping[str, Any] | None,
            now: str) -> dict[str, Any]:
    serving = _live(obs, ROLE_SERVING)
    warm = _live(obs, ROLE_WARM)
    ready = sum(p.containers_ready and p.gate for p in serving)
    warm_ready = sum(p.containers_ready for p in warm)
    outdated = sum(p.template_hash != obs.template_hash for p in serving + warm)

    conds = [
        _cond("Ready", ready >= obs.replicas,
              "AllReplicasReady" if ready >= obs.replicas else "ReplicasWarming",
              f"{ready}/{obs.replicas} serving pods ready"),
        _cond("WarmPoolReady", warm_ready >= obs.warm_pool,
              "PoolFull" if warm_ready >= obs.warm_pool else "PoolWarming",
              f"{warm_ready}/{obs.warm_pool} warm pods ready"),
    ]
    if not obs.snapshot_enabled:
        conds.append(_cond("SnapshotVolumeBound", True, "SnapshotsDisabled",
                           "snapshots are disabled"))
    else:
        bound = obs.snapshot_phase == "Bound"
        conds.append(_cond("SnapshotVolumeBound", bound, "Bound" if bound else "NotBound",
                           f"snapshot claim is {obs.snapshot_phase or 'absent'}"))
    if obs.degraded:
        conds.append(_cond("Degraded", True, obs.degraded[0], obs.degraded[1]))
    else:
        conds.append(_cond("Degraded", False, "AsExpected", "spec is valid"))

    # A condition's lastTransitionTime moves only when its status flips.
    before = {c.get("type"): c for c in (previous or {}).get("conditions") or []}
    for c in conds:
        old = before.get(c["type"])
        same = old is not None and old.get("status") == c["status"]
        c["lastTransitionTime"] = old.get("lastTransitionTime", now) if same else now

    if obs.degraded:
        phase = "Degraded"
    elif ready >= obs.replicas and warm_ready >= obs.warm_pool and not outdated \
            and len(serving) == obs.replicas and len(warm) == obs.warm_pool:
        phase = "Ready"
    elif obs.replicas > 0 and ready == 0:
        phase = "Pending"
    else:
        phase = "Progressing"

    status: dict[str, Any] = {
        "replicas": len(serving),
        "readyReplicas": ready,
        "warmReplicas": warm_ready,
        "selector": selector,
        "phase": phase,
        "conditions": conds,
    }
    if obs.generation is not None:
        status["observedGeneration"] = obs.generation
    return status
