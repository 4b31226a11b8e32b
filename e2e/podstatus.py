"""What the local kubelet reports about a pod: pure functions of the container's state.

The same rules as a kubelet: ContainersReady follows the readiness probe (ready after one
success, unready after failureThreshold failures in a row); Ready is ContainersReady and
every readinessGate condition True (the operator owns the preheat.dev/warm gate); a
container that exits is restarted in place under restartPolicy Always, else the pod ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ContainerState:
    running: bool = False
    started: bool = False  # the startup probe passed (readiness is probed only after)
    ready: bool = False
    started_at: str | None = None
    restart_count: int = 0
    failures: int = 0  # readiness probe failures in a row
    last_exit_code: int | None = None
    last_finished_at: str | None = None  # when the last container exited (RFC 3339)
    last_message: str | None = None  # its termination message (terminationMessagePath)
    waiting_reason: str | None = None  # e.g. ContainerCreating, CrashLoopBackOff
    # What the kubelet says with it, e.g. `secret "api-key" not found` for
    # CreateContainerConfigError (kubelet_pods.go's texts).
    waiting_message: str | None = None


def after_probe(state: ContainerState, ok: bool, failure_threshold: int) -> ContainerState:
    if ok:
        return replace(state, ready=True, failures=0)
    failures = state.failures + 1
    return replace(state, failures=failures,
                   ready=state.ready and failures < max(1, failure_threshold))


def on_exit(restart_policy: str, exit_code: int) -> str:
    """'restart' (in place) or the pod's final phase."""
    if restart_policy == "Always" or (restart_policy == "OnFailure" and exit_code != 0):
        return "restart"
    return "Succeeded" if exit_code == 0 else "Failed"


def gates_open(pod: Mapping[str, Any]) -> bool:
    gates = [g["conditionType"] for g in (pod.get("spec") or {}).get("readinessGates") or []]
    conds = {c.get("type"): c.get("status")
             for c in (pod.get("status") or {}).get("conditions") or []}
    return all(conds.get(g) == "True" for g in gates)


def _condition(previous: Mapping[str, Any], ctype: str, ok: bool, now: str) -> dict[str, str]:
    old = next((c for c in previous.get("conditions") or [] if c.get("type") == ctype), None)
    status = "True" if ok else "False"
    since = old.get("lastTransitionTime", now) if old and old.get("status") == status else now
    return {"type": ctype, "status": status, "lastTransitionTime": since}


def terminated(state: ContainerState, exit_code: int) -> dict[str, Any]:
    """A `terminated` container state: exit code, finish time, termination message."""
    out: dict[str, Any] = {"exitCode": exit_code}
    if state.last_finished_at:
        out["finishedAt"] = state.last_finished_at
    if state.last_message:
        out["message"] = state.last_message
    return out


def termination_message(written: str, log_tail: str, policy: str, exit_code: int) -> str:
    """What the kubelet reports as the message: the file the container wrote (at most
    4096 bytes); with terminationMessagePolicy FallbackToLogsOnError, when that is empty
    and the container failed, the end of its log (80 lines, 2048 bytes)."""
    if written:
        return written[:4096]
    if policy == "FallbackToLogsOnError" and exit_code != 0:
        return "\n".join(log_tail.splitlines()[-80:])[-2048:]
    return ""


def status(pod: Mapping[str, Any], state: ContainerState, phase: str, now: str,
           reason: str | None = None, message: str | None = None,
           pod_ip: str | None = "127.0.0.1") -> dict[str, Any]:
    """The pod status the kubelet writes (a strategic-merge patch: conditions merge by type,
    so the operator's gate condition is left alone)."""
    previous = pod.get("status") or {}
    name = ((pod.get("spec") or {}).get("containers") or [{}])[0].get("name", "main")
    ready = state.running and state.started and state.ready
    if state.running:
        cstate: dict[str, Any] = {"running": {"startedAt": state.started_at}}
    elif state.waiting_reason:
        cstate = {"waiting": {"reason": state.waiting_reason,
                              **({"message": state.waiting_message} if state.waiting_message else {})}}
    else:
        cstate = {"terminated": terminated(state, exit_code=state.last_exit_code or 0)}
    container: dict[str, Any] = {
        "name": name, "ready": ready, "started": state.running and state.started,
        "restartCount": state.restart_count, "state": cstate,
        "image": ((pod.get("spec") or {}).get("containers") or [{}])[0].get("image", ""),
    }
    if state.last_exit_code is not None:
        container["lastState"] = {"terminated": terminated(state, exit_code=state.last_exit_code)}
    out: dict[str, Any] = {
        "phase": phase,
        "hostIP": "127.0.0.1",
        "startTime": previous.get("startTime") or now,
        "containerStatuses": [container],
        "conditions": [
            _condition(previous, "PodScheduled", True, now),
            _condition(previous, "Initialized", True, now),
            _condition(previous, "ContainersReady", ready, now),
            _condition(previous, "Ready", ready and gates_open(pod), now),
        ],
    }
    if pod_ip:  # none before the pod's network exists
        out["podIP"] = pod_ip
    if reason:
        out["reason"], out["message"] = reason, message or ""
    return out


def _essence(st: Mapping[str, Any]) -> Any:
    """What a change is made of, without timestamps."""
    conds = {c.get("type"): c.get("status") for c in st.get("conditions") or []}
    containers = [(c.get("ready"), c.get("restartCount"), sorted((c.get("state") or {}).keys()),
                   ((c.get("lastState") or {}).get("terminated") or {}).get("message"),
                   ((c.get("state") or {}).get("waiting") or {}).get("reason"),
                   ((c.get("state") or {}).get("waiting") or {}).get("message"))
                  for c in st.get("containerStatuses") or []]
    return (st.get("phase"), st.get("podIP"), st.get("reason"),
            conds.get("ContainersReady"), conds.get("Ready"), containers)


def differs(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    return _essence(current or {}) != _essence(desired)
