"""The whole product on one machine: API emulator + provisioner + local kubelet + operator.

    async with local_cluster(tmp_path) as cluster:
        await cluster.kube.create(INFERENCE_SERVICES, "default", ...)

Everything it starts (engine processes, the operator) is stopped on the way out, also when
the body fails: the operator first, then the kubelet (SIGTERM, grace, SIGKILL per pod).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock
import kopf

from e2e.apiserver import KubeAPIServer, write_kubeconfig
from e2e.kubelet import LocalKubelet
from e2e.manifests import NAMESPACE
from e2e.operator_process import OperatorProcess
from e2e.provisioner import LocalProvisioner
from preheat.operator.kube import Kube

# The pod's `preheat` command, run from this checkout's interpreter.
COMMANDS = {"preheat": [sys.executable, "-m", "preheat"]}
# What a container would inherit from its image; nothing else leaks in from this shell.
_IMAGE_ENV = ("PATH", "LANG", "LC_ALL", "TZ")


def node_cache_dir() -> Path:
    """The node-wide directory behind the pods' `cache` emptyDir (see docs/e2e.md): the
    engine's weight cache lands in <it>/weights, the default ~/.cache/preheat/weights."""
    return Path(os.environ.get("PREHEAT_E2E_NODE_CACHE")
                or Path.home() / ".cache" / "preheat").expanduser()


@dataclass
class LocalCluster:
    kube: Kube  # a cluster user's client
    kubelet: LocalKubelet
    operator: OperatorProcess
    root: Path
    api: Any = None  # the KubeAPIServer, for diagnostics
    namespace: str = NAMESPACE

    # The scenario's driver interface (e2e/scenario.py), shared with the real-cluster one.
    async def endpoint(self, pod: str) -> str:
        return self.kubelet.url(pod)

    async def crash(self, pod: str) -> None:
        await self.kubelet.kill(pod, signal.SIGKILL)

    async def evict(self, pod: str) -> None:
        await self.kubelet.evict(pod)

    async def stop_operator(self) -> None:
        await self.operator.stop(signal.SIGKILL)  # a crash: nothing is cleaned up

    async def start_operator(self) -> None:
        await self.operator.start()

    def diagnostics(self, tail: int = 3000) -> str:
        """For a failed run: the operator's logs, the emulator's objects, the kubelet's view
        of each pod (which may lag the emulator's), and the end of every engine log. The
        full logs stay under self.root (pytest keeps the last three tmp_path trees)."""
        parts = [f"--- logs under {self.root}", f"--- operator\n{self.operator.logs()}"]
        if self.api is not None:
            parts.append(self.api.dump())
        parts.append(f"--- kubelet (stale pod versions ignored: "
                     f"{self.kubelet.stale_versions})")
        for rt in self.kubelet.pods.values():
            meta, st = rt.pod.get("metadata") or {}, rt.pod.get("status") or {}
            conds = {c.get("type"): c.get("status") for c in st.get("conditions") or []}
            parts.append(f"{rt.name} seen rv={meta.get('resourceVersion')} phase={rt.phase} "
                         f"state={rt.state} conditions={conds} port={rt.port} "
                         f"last probes={rt.probes[-3:]}")
        parts.append("finished here (no process): " + ", ".join(
            f"{rt.name} exits={rt.exit_codes}" for rt in self.kubelet.finished))
        for rt in [*self.kubelet.pods.values(), *self.kubelet.finished]:
            for path in rt.logs:
                text = path.read_text(errors="replace") if path.exists() else ""
                parts.append(f"--- pod {rt.name} {path.name} exits={rt.exit_codes}\n{text[-tail:]}")
        return "\n".join(parts)


@contextlib.asynccontextmanager
async def local_cluster(root: Path, resync_seconds: float = 2.0,
                        operator_args: tuple[str, ...] = ()) -> AsyncIterator[LocalCluster]:
    root.mkdir(parents=True, exist_ok=True)
    async with KubeAPIServer() as api, kmock.Server(api) as server:
        url = str(server.url).rstrip("/")
        kubeconfig = write_kubeconfig(root, url)
        base_env = {k: os.environ[k] for k in _IMAGE_ENV if k in os.environ}
        # The operator puts the weight cache on the snapshot claim (render.weight_cache_dir).
        async with LocalProvisioner(url, NAMESPACE, root, {"weights": node_cache_dir() / "weights"}), \
                LocalKubelet(url, NAMESPACE, root, commands=COMMANDS, base_env=base_env,
                             node_dirs={"cache": node_cache_dir()}, max_grace_s=30) as kubelet, \
                OperatorProcess(kubeconfig, NAMESPACE, root, resync_seconds,
                                operator_args) as operator:
            kube = Kube(kopf.ConnectionInfo(server=url))
            try:
                yield LocalCluster(kube=kube, kubelet=kubelet, operator=operator, root=root,
                                   api=api)
            finally:
                await kube.close()
