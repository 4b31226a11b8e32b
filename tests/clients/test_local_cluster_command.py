"""`python -m e2e.local_cluster` (docs/e2e.md): prints a KUBECONFIG that the real kubectl
drives, and stops everything it started on SIGTERM. No InferenceService is applied, so no
engine starts: the engines' side is e2e/test_local_scenario.py's."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "helm"))
from helm_tools import ensure_tools

ROOT = pathlib.Path(__file__).resolve().parents[2]
BAD = """apiVersion: serving.preheat.dev/v1alpha1
kind: InferenceService
metadata: {name: bad}
spec: {replicas: -4, model: {}, engine: {image: x}}
"""


@pytest.mark.timeout(180)
def test_the_command_prints_a_kubeconfig_kubectl_drives(tmp_path: pathlib.Path) -> None:
    kubectl = str(ensure_tools()["kubectl"])
    proc = subprocess.Popen([sys.executable, "-m", "e2e.local_cluster", "--dir", str(tmp_path / "cluster")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()  # printed once everything is up
        assert line.startswith("export KUBECONFIG="), (line, proc.stderr.read() if proc.poll() else "")
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "KUBECONFIG": line.split("=", 1)[1]}

        def kubectl_run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
            return subprocess.run([kubectl, *args], env=env, input=stdin, capture_output=True, text=True, timeout=60)

        listed = kubectl_run("get", "pis")
        assert listed.returncode == 0 and "No resources found in default namespace." in listed.stderr
        refused = kubectl_run("apply", "-f", "-", stdin=BAD)
        assert refused.returncode == 1 and "spec.replicas in body should be greater than or equal to 0" in \
            refused.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, proc.stderr.read() if proc.stderr else ""
