"""The whole product on one machine: API emulator + provisioner + scheduler + local kubelet
(several named nodes) + Service stand-ins + operator.

    async with local_cluster(tmp_path) as cluster:
        await cluster.kube.create(INFERENCE_SERVICES, "default", ...)

Everything it starts (engine processes, the operator) is stopped on the way out, also when
the body fails: the operator first, then the kubelet (SIGTERM, grace, SIGKILL per pod).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock
import kopf

from e2e.apiserver import KubeAPIServer, write_kubeconfig
from e2e.kubelet import LocalKubelet
from e2e.manifests import NAMESPACE
from e2e.nodes import DEFAULT_NODES, ClusterNodes
from e2e.operator_process import OperatorProcess
from e2e.provisioner import RWO_ONLY, LocalProvisioner
from e2e.scheduler import LocalScheduler
from e2e.service_proxy import ClusterServices
from preheat.operator.kube import STRATEGIC, Kube
from preheat.operator.resources import PODS

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
    services: ClusterServices | None = None
    scheduler: LocalScheduler | None = None

    # The scenario's driver interface (e2e/scenario.py), shared with the real-cluster one.
    async def endpoint(self, pod: str) -> str:
        return self.kubelet.url(pod)

    async def service_url(self, service: str) -> str:
        """Through the Service's stand-in (ready role=serving pods only, like kube-proxy)."""
        assert self.services is not None
        return await self.services.url(service)

    async def service_endpoints(self, service: str) -> set[str]:
        """The pods the Service's stand-in routes new connections to now."""
        assert self.services is not None
        return set((await self.services.proxy(service)).endpoints)

    async def service_connections(self, service: str) -> dict[str, int]:
        """Connections the Service's stand-in has sent to each pod so far."""
        assert self.services is not None
        return dict((await self.services.proxy(service)).stats.connections)

    async def crash(self, pod: str) -> None:
        await self.kubelet.kill(pod, signal.SIGKILL)

    async def hang(self, pod: str) -> None:
        """The engine stops answering (SIGSTOP): alive, its readiness probe failing."""
        await self.kubelet.kill(pod, signal.SIGSTOP)

    def node_of(self, pod: str) -> str:
        return self.kubelet.by_name(pod).node

    async def lose_node(self, node: str) -> list[str]:
        """The node vanishes: the kubelet's part (processes frozen, no more status), then
        the node controller's, compressed from its ~40 s grace to now: each of its pods is
        marked Ready=False (reason NodeNotReady), which takes it out of the endpoints."""
        names = await self.kubelet.lose_node(node)
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        for name in names:
            await self.kube.patch(PODS, self.namespace, name, {"status": {"conditions": [{
                "type": "Ready", "status": "False", "reason": "NodeNotReady",
                "message": f"node {node} is not ready (e2e harness)",
                "lastTransitionTime": now}]}}, subresource="status", content_type=STRATEGIC)
        if self.scheduler is not None:
            self.scheduler.poke()
        return names

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
            parts.append(f"{rt.name} on {rt.node}{' (lost)' if rt.node_lost else ''} "
                         f"seen rv={meta.get('resourceVersion')} phase={rt.phase} "
                         f"state={rt.state} conditions={conds} port={rt.port} "
                         f"last probes={rt.probes[-3:]}")
        if self.services is not None:
            for name, proxy in self.services.proxies.items():
                parts.append(f"service {name}: endpoints={sorted(proxy.endpoints)} "
                             f"stats={proxy.stats}")
        parts.append("finished here (no process): " + ", ".join(
            f"{rt.name} exits={rt.exit_codes}" for rt in self.kubelet.finished))
        for rt in [*self.kubelet.pods.values(), *self.kubelet.finished]:
            for path in rt.logs:
                text = path.read_text(errors="replace") if path.exists() else ""
                parts.append(f"--- pod {rt.name} {path.name} exits={rt.exit_codes}\n{text[-tail:]}")
        return "\n".join(parts)


@contextlib.asynccontextmanager
async def local_cluster(root: Path, resync_seconds: float = 2.0,
                        operator_args: tuple[str, ...] = (), *,
                        nodes: Sequence[str] = DEFAULT_NODES,
                        access_modes: Sequence[str] = RWO_ONLY,
                        propagation_s: float = 0.5) -> AsyncIterator[LocalCluster]:
    """access_modes: what the storage offers (default ReadWriteOnce only, like kind/k3d's
    local-path, EBS, GCE PD); propagation_s: how late the Service stand-ins follow pod
    readiness (kube-proxy's lag)."""
    root.mkdir(parents=True, exist_ok=True)
    async with KubeAPIServer() as api, kmock.Server(api) as server:
        url = str(server.url).rstrip("/")
        kubeconfig = write_kubeconfig(root, url)
        base_env = {k: os.environ[k] for k in _IMAGE_ENV if k in os.environ}
        cluster_nodes = ClusterNodes.named(tuple(nodes))
        kubelets: list[LocalKubelet] = []

        def address_of(pod: str) -> tuple[str, int] | None:
            try:
                rt = kubelets[0].by_name(pod)
            except (KeyError, IndexError):
                return None
            return (rt.ip, rt.port) if rt.ip and rt.port else None

        # The operator puts the weight cache on a shared snapshot claim (render.weight_cache_dir).
        async with LocalProvisioner(url, NAMESPACE, root, {"weights": node_cache_dir() / "weights"},
                                    access_modes=access_modes, node=nodes[0]), \
                LocalScheduler(url, NAMESPACE, cluster_nodes) as scheduler, \
                ClusterServices(url, NAMESPACE, address_of, propagation_s) as services, \
                LocalKubelet(url, NAMESPACE, root, commands=COMMANDS, base_env=base_env,
                             node_dirs={"cache": node_cache_dir()}, max_grace_s=30,
                             nodes=cluster_nodes, dns=services.address) as kubelet, \
                OperatorProcess(kubeconfig, NAMESPACE, root, resync_seconds,
                                operator_args) as operator:
            kubelets.append(kubelet)
            kube = Kube(kopf.ConnectionInfo(server=url))
            try:
                yield LocalCluster(kube=kube, kubelet=kubelet, operator=operator, root=root,
                                   api=api, services=services, scheduler=scheduler)
            finally:
                await kube.close()


async def serve_until_stopped(root: Path) -> None:
    """The local cluster until Ctrl-C or SIGTERM, with the KUBECONFIG for kubectl and helm
    printed first (`python -m e2e.local_cluster`, see docs/e2e.md)."""
    import asyncio

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with local_cluster(root):
        print(f"export KUBECONFIG={root / 'kubeconfig'}", flush=True)
        print(f"# Local Preheat cluster (API emulator, operator, local kubelet; namespace {NAMESPACE}).\n"
              f"# Logs under {root}. Ctrl-C stops it and every engine it started.", file=sys.stderr, flush=True)
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import asyncio
    import tempfile

    parser = argparse.ArgumentParser(
        prog="python -m e2e.local_cluster",
        description="Run the local cluster (API emulator + operator + local kubelet) until Ctrl-C and "
                    "print the KUBECONFIG that kubectl and helm use to drive it.")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the kubeconfig, pod directories and logs go (default: a new temporary one)")
    args = parser.parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="preheat-local-cluster-"))
    asyncio.run(serve_until_stopped(root.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
