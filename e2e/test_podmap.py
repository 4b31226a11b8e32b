"""How the local kubelet maps an operator-rendered pod onto a local process."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import podmap
from e2e.manifests import inference_service
from preheat.operator import render
from preheat.operator.spec import parse_spec

ROOT = Path("/node")
COMMANDS = {"preheat": ["/venv/bin/python", "-m", "preheat"]}


def operator_pod(**spec_overrides) -> dict:
    """A pod exactly as the operator renders it for the scenario's InferenceService."""
    body = inference_service("chat")
    body["spec"].update(spec_overrides)
    pod = render.pod("chat", "default", "uid-1", parse_spec(body["spec"]), "chat-abc123", "warm")
    pod["metadata"]["uid"] = "pod-uid"
    return pod


def test_the_container_command_runs_as_the_local_preheat_entry_with_its_args():
    pod = operator_pod()
    pod["spec"]["containers"][0]["args"] = ["--max-num-seqs", "4"]
    plan = podmap.plan(pod, commands=COMMANDS, host_port=41000, root=ROOT)
    assert plan.argv == ("/venv/bin/python", "-m", "preheat", "serve", "--max-num-seqs", "4")


def test_mounted_paths_in_env_become_local_directories():
    plan = podmap.plan(operator_pod(), commands=COMMANDS, host_port=41000, root=ROOT)
    pod_dir = ROOT / "pods" / "pod-uid" / "volumes"
    assert plan.env["PREHEAT_WARMUP_TEMPLATES"] == str(pod_dir / "warmup-templates")
    # Pod-local snapshots (the default): the pod's own emptyDir.
    assert plan.env["PREHEAT_SNAPSHOT_DIR"] == str(pod_dir / "snapshots")
    assert plan.env["HOME"] == str(pod_dir / "tmp")


def test_a_shared_snapshot_claim_is_one_directory_for_every_pod():
    pod = operator_pod(snapshot={"storage": "SharedVolume", "accessMode": "ReadWriteOnce"})
    plan = podmap.plan(pod, commands=COMMANDS, host_port=41000, root=ROOT)
    assert plan.env["PREHEAT_SNAPSHOT_DIR"] == str(ROOT / "claims" / "default" / "chat-snapshots")
    # The weight cache sits on the snapshot claim too, so pods share converted weights.
    assert plan.env["PREHEAT_WEIGHT_CACHE_DIR"] == str(ROOT / "claims" / "default" / "chat-snapshots" / "weights")


def test_a_service_url_in_env_reaches_the_services_stand_in():
    """Cluster DNS, mapped: the operator tells the engine its peers as the URL of the
    headless engines Service."""
    pod = operator_pod()
    assert podmap.service_hosts(pod) == [("chat-engines", 8000)]
    plan = podmap.plan(pod, commands=COMMANDS, host_port=41000, root=ROOT,
                       hosts={"chat-engines:8000": "127.0.0.1:40404"})
    assert plan.env["PREHEAT_SNAPSHOT_PEER_URL"] == "http://127.0.0.1:40404"
    assert podmap.rewrite_hosts("http://chat.default.svc.cluster.local:8000/x",
                                {"chat:8000": "127.0.0.1:1"}) == "http://127.0.0.1:1/x"
    assert podmap.rewrite_hosts("http://other:8000", {"chat:8000": "127.0.0.1:1"}) == \
        "http://other:8000"


def test_the_pre_stop_sleep_is_read_from_the_container():
    assert podmap.pre_stop_sleep_s(operator_pod()) == 1.0


def test_a_node_dir_replaces_a_pods_own_empty_dir():
    pod = operator_pod(snapshot={"enabled": False})  # weight cache on the pod's `cache` emptyDir
    plan = podmap.plan(pod, commands=COMMANDS, host_port=41000, root=ROOT,
                       node_dirs={"cache": Path("/shared/preheat")})
    assert plan.env["PREHEAT_WEIGHT_CACHE_DIR"] == "/shared/preheat/weights"


def test_the_pod_env_and_the_spec_env_reach_the_process_and_the_port_is_remapped():
    plan = podmap.plan(operator_pod(), commands=COMMANDS, host_port=41000, root=ROOT,
                       base_env={"PATH": "/usr/bin", "PREHEAT_PORT": "1"})
    assert plan.env["PATH"] == "/usr/bin"
    assert plan.env["PREHEAT_MAX_TOTAL_TOKENS"] == "4096"  # from spec.engine.env
    assert plan.env["PREHEAT_SERVED_MODEL_NAME"] == "chat"
    assert (plan.env["PREHEAT_HOST"], plan.env["PREHEAT_PORT"]) == ("127.0.0.1", "41000")
    assert (plan.container_port, plan.host_port) == (8000, 41000)


def test_field_and_secret_refs_resolve_and_unknown_sources_are_refused():
    pod = operator_pod()
    env = pod["spec"]["containers"][0]["env"]
    env.append({"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    plan = podmap.plan(pod, commands=COMMANDS, host_port=1, root=ROOT)
    assert plan.env["POD"] == "chat-abc123"
    env.append({"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}})
    assert podmap.secret_names(pod) == ["s"]
    # The kubelet fetches the Secret before the container starts; the plan uses its value.
    plan = podmap.plan(pod, commands=COMMANDS, host_port=1, root=ROOT, secrets={"s": {"k": "v"}})
    assert plan.env["KEY"] == "v"
    with pytest.raises(podmap.Unsupported, match="KEY"):
        podmap.plan(pod, commands=COMMANDS, host_port=1, root=ROOT, secrets={"s": {}})
    env[-1] = {"name": "CM", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}
    with pytest.raises(podmap.Unsupported, match="CM"):
        podmap.plan(pod, commands=COMMANDS, host_port=1, root=ROOT)


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c.update(command=["python", "app.py"]), "only knows"),
    (lambda c: c.update(args=["--port", "9000"]), "owns the address"),
    (lambda c: c.update(ports=[]), "one container port"),
])
def test_what_cannot_be_mapped_is_refused_not_guessed(mutate, message):
    pod = operator_pod()
    mutate(pod["spec"]["containers"][0])
    with pytest.raises(podmap.Unsupported, match=message):
        podmap.plan(pod, commands=COMMANDS, host_port=1, root=ROOT)


def test_probes_come_from_the_pod_spec_and_aim_at_the_mapped_port():
    pod = operator_pod()
    ready = podmap.probe(pod, "readinessProbe", 41000)
    assert (ready.path, ready.host_port, ready.period_s, ready.failure_threshold) == \
        ("/ready", 41000, 1.0, 3)
    startup = podmap.probe(pod, "startupProbe", 41000)
    assert (startup.path, startup.period_s) == ("/health", float(render.STARTUP_PERIOD_S))
    assert podmap.probe(pod, "livenessProbe", 41000).path == "/health"
    del pod["spec"]["containers"][0]["readinessProbe"]
    assert podmap.probe(pod, "readinessProbe", 41000) is None


def test_rewrite_picks_the_longest_mount_and_leaves_other_paths_alone():
    mounts = {"/var": Path("/a"), "/var/cache/preheat": Path("/b")}
    assert podmap.rewrite_path("/var/cache/preheat/weights", mounts) == "/b/weights"
    assert podmap.rewrite_path("/var/log", mounts) == "/a/log"
    assert podmap.rewrite_path("/variable", mounts) == "/variable"
    assert podmap.grace_period_s(operator_pod()) == 20.0


def test_model_credentials_envfrom_cache_hostpath_and_termination_log():
    """A hub model with a credentials Secret and a node-local cache: the Secret's keys are
    the process's env (the pod's own env wins), the hostPath is the node's directory, and
    the termination message file is named to the engine."""
    pod = operator_pod(model={"uri": "hf://org/name", "credentialsSecretRef": {"name": "hf"},
                              "cache": {"storage": "NodeLocal"}})
    pod["spec"]["nodeName"] = "node-b"
    assert podmap.secret_names(pod) == ["hf"]
    plan = podmap.plan(pod, commands=COMMANDS, host_port=41000, root=ROOT,
                       secrets={"hf": {"HF_TOKEN": "hf_x", "PREHEAT_PORT": "1"}},
                       termination_log=ROOT / "t.log")
    assert plan.env["HF_TOKEN"] == "hf_x"
    assert plan.env["PREHEAT_PORT"] == "41000"  # env (and the kubelet's own) wins over envFrom
    assert plan.env["PREHEAT_DOWNLOAD_DIR"] == str(ROOT / "nodes" / "node-b" / "hostpath" / "var/cache/preheat/models")
    assert plan.env["PREHEAT_TERMINATION_MESSAGE_PATH"] == str(ROOT / "t.log")
    with pytest.raises(podmap.Unsupported, match="not fetched"):
        podmap.plan(pod, commands=COMMANDS, host_port=41000, root=ROOT)


def test_a_pod_that_keeps_its_token_finds_the_api_as_in_a_cluster(tmp_path):
    router = {"spec": {"containers": [{"name": "router"}], "automountServiceAccountToken": True}}
    engine = {"spec": {"containers": [{"name": "engine"}], "automountServiceAccountToken": False}}
    assert podmap.mounts_service_account(router) and podmap.mounts_service_account({"spec": {}})
    assert not podmap.mounts_service_account(engine)
    env = podmap.service_account_env("http://127.0.0.1:41234", tmp_path)
    assert env == {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "41234",
                   "PREHEAT_ROUTER_SERVICE_ACCOUNT_DIR": str(tmp_path)}
