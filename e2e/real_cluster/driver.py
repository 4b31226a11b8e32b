"""The scenario's Driver for a real cluster: the kubeconfig's credentials, kubectl for
port-forward and exec, and the operator run from this checkout as a local process (so the
scenario can crash and restart it). Needs kubectl on PATH and the engine image pullable by
the cluster (E2E_ENGINE_IMAGE)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import kopf

from e2e.operator_process import OperatorProcess
from preheat.operator.kube import Kube
from preheat.operator.resources import PODS

ROOT = Path(__file__).resolve().parents[2]
_FORWARDING = re.compile(rb"Forwarding from 127\.0\.0\.1:(\d+)")


def connection_from_kubeconfig() -> kopf.ConnectionInfo:
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(client_configuration=cfg)
    token = (cfg.api_key or {}).get("authorization", "")
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        certificate_path=cfg.cert_file, private_key_path=cfg.key_file,
        scheme="Bearer" if token else None, token=token.removeprefix("Bearer ") or None)


def kubectl(*args: str) -> str:
    return subprocess.run(["kubectl", *args], check=True, capture_output=True, text=True,
                          timeout=120).stdout


class RealCluster:
    def __init__(self, namespace: str, log_dir: Path) -> None:
        self.namespace = namespace
        self.kube = Kube(connection_from_kubeconfig())
        self.operator = OperatorProcess(Path(os.environ["KUBECONFIG"]), namespace, log_dir)
        self._forwards: dict[str, tuple[asyncio.subprocess.Process, str]] = {}

    async def __aenter__(self) -> RealCluster:
        kubectl("apply", "-f", str(ROOT / "crds"))
        kubectl("wait", "--for=condition=Established", "--timeout=60s",
                "crd/inferenceservices.serving.preheat.dev")
        await self.operator.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for proc, _ in self._forwards.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        await self.operator.stop()
        await self.kube.close()

    async def endpoint(self, pod: str) -> str:
        """A `kubectl port-forward` to the pod's engine port, kept for the run."""
        if pod not in self._forwards:
            proc = await asyncio.create_subprocess_exec(
                "kubectl", "-n", self.namespace, "port-forward", f"pod/{pod}", ":8000",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            m = _FORWARDING.search(line)
            assert m, f"kubectl port-forward said {line!r}"
            self._forwards[pod] = (proc, f"http://127.0.0.1:{int(m.group(1))}")
        return self._forwards[pod][1]

    async def crash(self, pod: str) -> None:
        # The engine is PID 1 in its container, which only takes signals it handles:
        # SIGTERM ends it (exit 0) and the kubelet restarts the container in place.
        await asyncio.to_thread(kubectl, "-n", self.namespace, "exec", pod, "--", "python",
                                "-c", "import os, signal; os.kill(1, signal.SIGTERM)")

    async def evict(self, pod: str) -> None:
        # The Eviction API (what `kubectl drain` uses): the pod is deleted gracefully.
        # Kube has no verb for a subresource POST, hence its raw call.
        await self.kube._call("POST", PODS.path(self.namespace, pod, "eviction"), body={
            "apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": pod, "namespace": self.namespace}})

    async def stop_operator(self) -> None:
        await self.operator.stop(signal.SIGKILL)

    async def start_operator(self) -> None:
        await self.operator.start()
