"""The InferenceService status as a pure function of what was observed.

Conditions (each with the generation it describes, `observedGeneration`):

- Ready: `replicas` serving pods are ready (the Service has its capacity);
- WarmPoolReady: `warmPool.size` warm pods are ready to be promoted (engine warm, and the
  operator has opened their warm gate);
- SnapshotVolumeBound: the shared snapshot claim is Bound (True when there is none to bind);
  a claim that stays Pending — typically ReadWriteMany on ReadWriteOnce-only storage — says
  so here instead of leaving every pod silently Pending;
- Degraded: the spec cannot be acted on (reason and message say why);
- Progressing: as a Deployment's — True while pods move towards the spec and when done
  (reason RolloutComplete); False with reason ProgressDeadlineExceeded once nothing has
  moved for `rollout.progressDeadlineSeconds` (the rollout is not stopped, only reported);
- FailoverBackoff: True while repeated failovers are being held back (decide.failover_delay);
- SnapshotStorageSufficient: `snapshot.size` holds what the engines keep on it (KV bytes per
  token x max tokens x (keep + 2), plus the converted weights on a shared claim:
  snapshot_storage.py); Unknown until an engine of the current template has published
  its bytes per token;
- ModelUnavailable: True while pods of the current template cannot start because the engine
  could not get the model (it does not exist, or the credentials were refused); the message
  is the engine's, from the pod's termination message. The kubelet's restart back-off and
  the failover back-off pace the retries.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from preheat.operator.decide import FailoverHistory, failing_since
from preheat.operator.pods import PodView, parse_time
from preheat.operator.resources import ROLE_SERVING, ROLE_WARM
from preheat.operator.snapshot_storage import EngineFacts, StorageCheck, Verdict, check


@dataclass(frozen=True)
class Observation:
    replicas: int  # spec.replicas
    warm_pool: int
    template_hash: str
    pods: tuple[PodView, ...]
    snapshot_enabled: bool
    snapshot_phase: str | None  # the shared claim's status.phase, None when absent
    degraded: tuple[str, str] | None  # (reason, message)
    generation: int | None
    snapshot_shared: bool = False  # a shared claim is wanted (snapshot.storage SharedVolume)
    snapshot_access_mode: str = ""
    progress_deadline_seconds: float = 600.0
    history: FailoverHistory = FailoverHistory()
    backoff_until: float | None = None
    failing: tuple[str, ...] = ()  # serving pods failing, no replacement promoted yet
    snapshot_size: str = "10Gi"  # spec.snapshot.size
    snapshot_cache_weights: bool = True  # spec.snapshot.cacheWeights
    engine_facts: EngineFacts | None = None  # what an engine of this template published

    def storage_check(self) -> StorageCheck:
        return StorageCheck(enabled=self.snapshot_enabled, shared=self.snapshot_shared,
                            size=self.snapshot_size, cache_weights=self.snapshot_cache_weights,
                            facts=self.engine_facts)


def _rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _live(obs: Observation, role: str) -> list[PodView]:
    return [p for p in obs.pods if p.role == role and not p.terminating and not p.dead]


def _cond(ctype: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": ctype, "status": "True" if ok else "False", "reason": reason,
            "message": message}


MODEL_UNAVAILABLE = "ModelUnavailable"  # the engine's termination message starts with it (engine/termination.py)


def model_unavailable(obs: Observation) -> PodView | None:
    """A live, unready pod of the current template whose engine last exited for want of
    the model; a ready pod of that template means the model is there after all."""
    current = [p for p in obs.pods if p.template_hash == obs.template_hash and not p.terminating]
    if any(p.containers_ready for p in current):
        return None
    return next((p for p in current if p.termination_message.startswith(MODEL_UNAVAILABLE + ":")), None)


def serves(p: PodView) -> bool:
    """Ready as the Service sees it: warm, gate open, and not on a lost node."""
    return p.containers_ready and p.gate and failing_since(p, True) is None


@dataclass(frozen=True)
class _Counts:
    """The pods as the status counts them."""
    serving: int  # live serving pods
    warm: int  # live warm pods
    ready: int  # serving pods the Service sends to
    warm_ready: int
    updated: int  # live pods of the current template
    updated_ready: int
    outdated: int
    unschedulable: tuple[PodView, ...]


def _count(obs: Observation) -> _Counts:
    serving = _live(obs, ROLE_SERVING)
    warm = _live(obs, ROLE_WARM)
    # Like a serving pod, a warm pod counts once its gate is open: until then the operator
    # has not acted on its readiness (a status computed from a fresh list of pods could
    # otherwise say "pool full" — and phase Ready — a pass before the gate opens).
    warm_ready = sum(p.containers_ready and p.gate and failing_since(p, False) is None
                     for p in warm)
    updated = [p for p in serving + warm if p.template_hash == obs.template_hash]
    return _Counts(
        serving=len(serving), warm=len(warm), ready=sum(serves(p) for p in serving),
        warm_ready=warm_ready, updated=len(updated),
        updated_ready=sum(p.containers_ready for p in updated),
        outdated=len(serving) + len(warm) - len(updated),
        unschedulable=tuple(p for p in serving + warm if p.unschedulable_since is not None))


def _complete(obs: Observation, n: _Counts) -> bool:
    return (not n.outdated and n.ready >= obs.replicas and n.serving == obs.replicas
            and n.warm_ready >= obs.warm_pool and n.warm == obs.warm_pool)


def _ready_condition(obs: Observation, n: _Counts) -> dict[str, Any]:
    message = f"{n.ready}/{obs.replicas} serving pods ready"
    if obs.failing:
        message += f"; failing, waiting for a warm replacement: {', '.join(obs.failing)}"
    if n.unschedulable:
        message += (f"; {len(n.unschedulable)} pod(s) cannot be scheduled: "
                    f"{n.unschedulable[0].unschedulable_message or 'Unschedulable'}")
    ok = n.ready >= obs.replicas
    reason = "AllReplicasReady" if ok else ("PodsUnschedulable" if n.unschedulable else "ReplicasWarming")
    return _cond("Ready", ok, reason, message)


def _degraded_condition(obs: Observation) -> dict[str, Any]:
    if obs.degraded:
        return _cond("Degraded", True, obs.degraded[0], obs.degraded[1])
    return _cond("Degraded", False, "AsExpected", "spec is valid")


def _signature(obs: Observation, n: _Counts) -> dict[str, Any]:
    """What progress means: anything about the new template's pods moved since the last status."""
    return {"templateHash": obs.template_hash, "updatedReplicas": n.updated,
            "updatedReadyReplicas": n.updated_ready, "outdatedReplicas": n.outdated,
            "readyReplicas": n.ready, "warmReplicas": n.warm_ready}


def _progressing_condition(obs: Observation, n: _Counts, previous: Mapping[str, Any],
                           before: Mapping[str, Any], now: str) -> dict[str, Any]:
    moved = any(previous.get(k) != v for k, v in _signature(obs, n).items())
    last_progress = now if moved else (before.get("Progressing") or {}).get("lastUpdateTime", now)
    now_s = parse_time(now) or 0.0
    stalled_for = now_s - (parse_time(last_progress) or now_s)
    left = (f"{n.updated_ready}/{obs.replicas + obs.warm_pool} pods of template "
            f"{obs.template_hash} ready, {n.outdated} outdated left")
    if _complete(obs, n):
        progressing = _cond("Progressing", True, "RolloutComplete",
                            f"{n.updated} pods on template {obs.template_hash}, all ready")
    elif obs.degraded:
        progressing = _cond("Progressing", False, "Degraded", obs.degraded[1])
    elif stalled_for > obs.progress_deadline_seconds:
        progressing = _cond("Progressing", False, "ProgressDeadlineExceeded",
                            f"no progress for {int(stalled_for)}s (deadline "
                            f"{int(obs.progress_deadline_seconds)}s): {left}")
    else:
        progressing = _cond("Progressing", True, "RollingOut" if n.outdated else "PodsWarming", left)
    progressing["lastUpdateTime"] = last_progress
    return progressing


def _failover_condition(obs: Observation) -> dict[str, Any]:
    if obs.backoff_until is not None:
        return _cond("FailoverBackoff", True, "RepeatedFailures",
                     f"{obs.history.count} failovers in a row; the next one waits "
                     f"until {_rfc3339(obs.backoff_until)}")
    return _cond("FailoverBackoff", False, "NoBackoff",
                 f"{obs.history.count} failovers in the current streak")


def _model_condition(obs: Observation) -> dict[str, Any]:
    missing = model_unavailable(obs)
    if missing is not None:
        return _cond(MODEL_UNAVAILABLE, True, "ModelNotFoundOrRefused",
                     f"pod {missing.name}: {missing.termination_message.removeprefix(MODEL_UNAVAILABLE + ': ')}")
    return _cond(MODEL_UNAVAILABLE, False, "ModelAvailable",
                 "no pod reported a missing model or refused credentials")


def _stamp(conds: list[dict[str, Any]], before: Mapping[str, Any], now: str,
           generation: int | None) -> None:
    """A condition's lastTransitionTime moves only when its status flips."""
    for c in conds:
        old = before.get(c["type"])
        same = old is not None and old.get("status") == c["status"]
        c["lastTransitionTime"] = old.get("lastTransitionTime", now) if same else now
        if generation is not None:
            c["observedGeneration"] = generation


def _phase(obs: Observation, n: _Counts) -> str:
    if obs.degraded:
        return "Degraded"
    if _complete(obs, n):
        return "Ready"
    if obs.replicas > 0 and n.ready == 0:
        return "Pending"
    return "Progressing"


def _storage_status(obs: Observation, verdict: Verdict,
                    previous: Mapping[str, Any]) -> dict[str, Any]:
    """status.snapshotStorage: the facts the check used, for this template (reconcile reads
    them back instead of asking the pods again), and its numbers; None removes an entry
    that no longer applies."""
    if obs.engine_facts is not None and obs.snapshot_enabled:
        return {"snapshotStorage": {**obs.engine_facts.as_status(obs.template_hash),
                                    "neededBytes": verdict.needed_bytes,
                                    "sizeBytes": verdict.size_bytes}}
    return {"snapshotStorage": None} if previous.get("snapshotStorage") else {}


def compute(obs: Observation, selector: str, previous: Mapping[str, Any] | None,
            now: str) -> dict[str, Any]:
    previous = previous or {}
    before = {c.get("type"): c for c in previous.get("conditions") or []}
    n = _count(obs)
    storage = check(obs.storage_check())
    conds = [
        _ready_condition(obs, n),
        _cond("WarmPoolReady", n.warm_ready >= obs.warm_pool,
              "PoolFull" if n.warm_ready >= obs.warm_pool else "PoolWarming",
              f"{n.warm_ready}/{obs.warm_pool} warm pods ready"),
        _snapshot_condition(obs),
        storage.condition(),
        _degraded_condition(obs),
        _progressing_condition(obs, n, previous, before, now),
        _failover_condition(obs),
        _model_condition(obs),
    ]
    _stamp(conds, before, now, obs.generation)
    status: dict[str, Any] = {
        "replicas": n.serving,
        "selector": selector,
        "phase": _phase(obs, n),
        **_signature(obs, n),
        "conditions": conds,
    }
    status.update(_storage_status(obs, storage, previous))
    if obs.history.last is not None:
        status["failover"] = {"count": obs.history.count, "lastTime": _rfc3339(obs.history.last)}
    if obs.generation is not None:
        status["observedGeneration"] = obs.generation
    return status


def _snapshot_condition(obs: Observation) -> dict[str, Any]:
    if not obs.snapshot_enabled:
        return _cond("SnapshotVolumeBound", True, "SnapshotsDisabled", "snapshots are disabled")
    if not obs.snapshot_shared:
        return _cond("SnapshotVolumeBound", True, "PodLocal",
                     "snapshots live on each pod's own volume; a new pod fetches one from a "
                     "ready peer (no claim to bind)")
    if obs.snapshot_phase == "Bound":
        return _cond("SnapshotVolumeBound", True, "Bound", "snapshot claim is Bound")
    return _cond("SnapshotVolumeBound", False, "ClaimPending",
                 f"snapshot claim is {obs.snapshot_phase or 'absent'}: pods that mount it stay "
                 f"Pending until it binds. A claim that stays Pending usually means the storage "
                 f"class cannot provide accessMode {obs.snapshot_access_mode or '?'} (most "
                 f"ReadWriteOnce-only classes: local-path, EBS, GCE PD cannot give "
                 f"ReadWriteMany); use snapshot.storage: PodLocal or a ReadWriteMany class")
