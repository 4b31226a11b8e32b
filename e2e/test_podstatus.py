"""What the local kubelet reports, following a kubelet's rules."""

from __future__ import annotations

from e2e import podstatus
from e2e.podstatus import ContainerState, status, termination_message

GATE = "preheat.dev/warm"


def pod(conditions=(), gates=(GATE,)) -> dict:
    return {"spec": {"containers": [{"name": "engine", "image": "img"}],
                     "readinessGates": [{"conditionType": g} for g in gates]},
            "status": {"conditions": [{"type": t, "status": s} for t, s in conditions]}}


def conds(status: dict) -> dict:
    return {c["type"]: c["status"] for c in status["conditions"]}


RUNNING_READY = ContainerState(running=True, started=True, ready=True, started_at="t0")


def test_ready_waits_for_the_readiness_gate_that_the_operator_opens():
    closed = podstatus.status(pod(), RUNNING_READY, "Running", "t1")
    assert conds(closed)["ContainersReady"] == "True" and conds(closed)["Ready"] == "False"
    opened = podstatus.status(pod([(GATE, "True")]), RUNNING_READY, "Running", "t1")
    assert conds(opened)["Ready"] == "True"
    assert opened["podIP"] == "127.0.0.1" and opened["phase"] == "Running"
    [c] = opened["containerStatuses"]
    assert (c["name"], c["ready"], c["started"], c["restartCount"]) == ("engine", True, True, 0)


def test_nothing_is_ready_before_the_startup_probe_passes():
    state = ContainerState(running=True, started=False, ready=True)
    st = podstatus.status(pod([(GATE, "True")]), state, "Running", "t1")
    assert conds(st)["ContainersReady"] == "False" and conds(st)["Ready"] == "False"


def test_the_gate_condition_is_never_written_by_the_kubelet():
    st = podstatus.status(pod([(GATE, "True")]), RUNNING_READY, "Running", "t1")
    assert GATE not in conds(st)  # a strategic merge leaves the operator's condition alone


def test_readiness_flips_on_one_success_and_after_failure_threshold_failures():
    s = ContainerState(running=True, started=True)
    s = podstatus.after_probe(s, True, 3)
    assert s.ready
    for _ in range(2):
        s = podstatus.after_probe(s, False, 3)
        assert s.ready
    s = podstatus.after_probe(s, False, 3)
    assert not s.ready
    assert podstatus.after_probe(s, True, 3).ready


def test_exits_follow_the_restart_policy():
    assert podstatus.on_exit("Always", 0) == "restart"
    assert podstatus.on_exit("Always", 137) == "restart"
    assert podstatus.on_exit("OnFailure", 1) == "restart"
    assert podstatus.on_exit("OnFailure", 0) == "Succeeded"
    assert podstatus.on_exit("Never", 1) == "Failed"


def test_a_restarted_container_reports_its_count_and_last_exit():
    state = ContainerState(running=True, started=True, ready=False, restart_count=1,
                           last_exit_code=137, started_at="t2")
    [c] = podstatus.status(pod(), state, "Running", "t3")["containerStatuses"]
    assert c["restartCount"] == 1 and c["lastState"] == {"terminated": {"exitCode": 137}}
    assert c["state"] == {"running": {"startedAt": "t2"}}


def test_transition_times_move_only_when_a_condition_flips():
    first = podstatus.status(pod(), RUNNING_READY, "Running", "t1")
    again = podstatus.status({**pod(), "status": first}, RUNNING_READY, "Running", "t9")
    assert [c["lastTransitionTime"] for c in again["conditions"]] == ["t1"] * 4
    assert not podstatus.differs(first, again)
    unready = podstatus.status({**pod(), "status": first},
                               ContainerState(running=True, started=True), "Running", "t9")
    assert podstatus.differs(first, unready)
    assert {c["type"]: c["lastTransitionTime"] for c in unready["conditions"]}["ContainersReady"] == "t9"


def test_an_evicted_pod_reports_failed_with_its_reason():
    state = ContainerState(running=False, last_exit_code=0)
    st = podstatus.status(pod(), state, "Failed", "t1", "Evicted", "low on memory")
    assert (st["phase"], st["reason"], st["message"]) == ("Failed", "Evicted", "low on memory")
    assert st["containerStatuses"][0]["state"] == {"terminated": {"exitCode": 0}}


def test_the_termination_message_is_reported_in_last_state():
    state = ContainerState(restart_count=1, last_exit_code=1, last_finished_at="2026-01-01T00:00:00Z",
                           last_message="ModelUnavailable: hf://org/x: repository not found",
                           waiting_reason="CrashLoopBackOff")
    st = status(pod(), state, "Running", "2026-01-01T00:00:01Z")
    assert st["containerStatuses"][0]["lastState"]["terminated"]["message"].startswith("ModelUnavailable:")
    assert termination_message("", "a\nb\nboom", "FallbackToLogsOnError", 1) == "a\nb\nboom"
    assert termination_message("", "boom", "File", 1) == ""
    assert termination_message("written", "boom", "FallbackToLogsOnError", 1) == "written"
