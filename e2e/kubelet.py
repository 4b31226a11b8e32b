"""The local kubelet: TEST HARNESS code that runs each Pod's container as a local process.

It is not a Kubernetes component and isolates nothing (no image, no namespaces, no cgroups).
It does what the operator and the scenario can observe of a kubelet:

- watches the Pods of one namespace; for each new pod it lays out the volumes as local
  directories, starts the container's command + args as a process in its own process group
  (podmap.plan: env mapped, secretKeyRefs read from the API first; the pod's own loopback
  IP, its container port), and writes
  the pod status;
- probes the startupProbe, then the readinessProbe, at their periods, and reports
  ContainersReady / Ready (Ready also waits for the pod's readinessGates, which the operator
  opens) with containerStatuses, the pod's IP, phase Running;
- restarts an exited container in place under restartPolicy Always (restartCount + 1);
- the termination message: each container start gets a fresh file for its
  terminationMessagePath (podmap.plan), and what the process wrote there (or, with
  FallbackToLogsOnError, its log's end) is reported in state/lastState.terminated.message;
- hostPath volumes: one directory per node (shared by that node's pods only);
- on pod deletion runs the preStop sleep, then sends SIGTERM to the process group, SIGKILL
  after the grace period (the sleep counts against it);
- evict(): what a kubelet does under node pressure — stop the container, phase Failed;
- nodes: it runs only pods bound (spec.nodeName, by e2e/scheduler.py) to one of the
  harness's nodes; lose_node() is that node going away: its processes are frozen
  (SIGSTOP: connections hang, as to a machine that vanished) and nothing is reported for
  its pods any more; a pod of a lost node that is deleted is killed at once;
- cluster DNS: an env value naming a Service (`http://<service>:<port>`) is rewritten to
  the address of that Service's stand-in (e2e/service_proxy.py), through `dns`;
- API credentials, as a cluster gives them to a pod that does not opt out
  (automountServiceAccountToken): a token, the namespace file (no ca.crt: the emulator
  speaks plain HTTP) and KUBERNETES_SERVICE_HOST/PORT; the token directory's local path
  is passed in env, as the pod IP is (podmap.service_account_env).

Liveness probes, resource limits, image pulls and init containers are not modelled.
envFrom takes Secrets only (secretRef), not ConfigMaps.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from e2e import podmap, podstatus
from e2e.nodes import ClusterNodes
from e2e.watch import watch

log = logging.getLogger(__name__)
STRATEGIC = {"Content-Type": "application/strategic-merge-patch+json"}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def free_pod_ip(port: int) -> str:
    """A loopback address of its own for a pod (the whole 127.0.0.0/8 is local on Linux),
    on which `port` is free: pods listen on their container port as on a cluster network,
    and podIP:port reaches them (the operator scrapes /metrics there)."""
    for _ in range(200):
        ip = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}.{random.randint(1, 254)}"
        with socket.socket() as s:
            try:
                s.bind((ip, port))
            except OSError:
                continue
        return ip
    raise RuntimeError(f"no loopback address with port {port} free")


def _rv(pod: Mapping[str, Any]) -> int:
    rv = str((pod.get("metadata") or {}).get("resourceVersion") or "")
    return int(rv) if rv.isdigit() else -1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class PodRuntime:
    uid: str
    name: str
    pod: dict[str, Any]  # the latest object seen
    state: podstatus.ContainerState = field(default_factory=podstatus.ContainerState)
    phase: str = "Pending"
    reason: str | None = None
    message: str | None = None
    ip: str | None = None  # the pod IP: a loopback address of its own, kept across restarts
    port: int | None = None  # the container port, on ip
    plan: podmap.ProcessPlan | None = None  # how the container was mapped, last start
    proc: asyncio.subprocess.Process | None = None
    pids: list[int] = field(default_factory=list)  # every process started for this pod
    exit_codes: list[int] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    probes: list[tuple[float, str, bool]] = field(default_factory=list)  # (s since start, path, ok)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    final_phase: str | None = None  # set by evict(): the phase to report after stopping
    kill_now: bool = False  # a hard eviction: no preStop, no grace
    task: asyncio.Task | None = None
    node: str = ""
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> decoded data

    @property
    def node_lost(self) -> bool:
        return self.lost_nodes is not None and self.lost_nodes.lost(self.node)

    lost_nodes: ClusterNodes | None = None


class LocalKubelet:
    def __init__(self, api_url: str, namespace: str, root: Path, *,
                 commands: Mapping[str, Sequence[str]],
                 node_dirs: Mapping[str, Path] | None = None,
                 base_env: Mapping[str, str] | None = None,
                 restart_backoff_s: float = 1.0, max_grace_s: float | None = None,
                 nodes: ClusterNodes | None = None,
                 dns: Callable[[str, int], Awaitable[str | None]] | None = None) -> None:
        self.namespace = namespace
        self.nodes = nodes if nodes is not None else ClusterNodes.named()
        self.dns = dns
        self.root = root
        self.commands = dict(commands)
        self.node_dirs = dict(node_dirs or {})
        self.base_env = dict(base_env or {})
        self.restart_backoff_s = restart_backoff_s  # a real kubelet starts at 10 s
        self.max_grace_s = max_grace_s  # caps the grace period at harness shutdown only
        self.pods: dict[str, PodRuntime] = {}  # uid -> runtime, while the pod exists
        self.finished: list[PodRuntime] = []
        self.api_url = api_url.rstrip("/")
        self._client = httpx.AsyncClient(base_url=self.api_url, timeout=10)
        self._tasks: list[asyncio.Task] = []
        self._done: set[str] = set()  # uids whose pod has finished here
        self._closing = False
        self.stale_versions = 0  # pod versions older than one already seen, ignored (_seen)

    # -- what tests ask --

    def by_name(self, name: str) -> PodRuntime:
        for rt in self.pods.values():
            if rt.name == name:
                return rt
        raise KeyError(f"no running pod {name!r}")

    def url(self, name: str) -> str:
        rt = self.by_name(name)
        assert rt.port is not None, f"pod {name} has no process yet"
        return f"http://{rt.ip}:{rt.port}"

    def all_pids(self) -> list[int]:
        return [pid for rt in [*self.pods.values(), *self.finished] for pid in rt.pids]

    def live_pids(self) -> list[int]:
        return [pid for pid in self.all_pids() if _alive(pid)]

    async def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Crash the pod's container (as an OOM kill would); returns the pid killed."""
        rt = self.by_name(name)
        assert rt.proc is not None and rt.proc.returncode is None, f"{name} is not running"
        os.killpg(rt.proc.pid, sig)
        return rt.proc.pid

    def pods_on(self, node: str) -> list[PodRuntime]:
        return [rt for rt in self.pods.values() if rt.node == node]

    async def lose_node(self, node: str) -> list[str]:
        """The node goes away: its engines freeze (SIGSTOP) and its pods get no more status
        from here. Returns the pods that were on it. (The node controller's part, marking
        them not Ready, is the local cluster's: local_cluster.LocalCluster.lose_node.)"""
        self.nodes.lose(node)
        names = []
        for rt in self.pods_on(node):
            names.append(rt.name)
            if rt.proc is not None and rt.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(rt.proc.pid, signal.SIGSTOP)
                    await _until_stopped(rt.proc.pid)
        return names

    async def evict(self, name: str, reason: str = "Evicted",
                    message: str = "the node was low on resources (e2e harness)",
                    hard: bool = True) -> None:
        """Node-pressure eviction. Hard (the kubelet's default thresholds: memory.available,
        nodefs.available...): the container is killed at once, no preStop, no grace. Soft:
        the pod's graceful stop, at most its grace period."""
        rt = self.by_name(name)
        rt.reason, rt.message, rt.final_phase = reason, message, "Failed"
        rt.kill_now = hard
        rt.stop.set()
        if rt.task is not None:
            await asyncio.shield(rt.task)

    # -- lifecycle --

    async def __aenter__(self) -> LocalKubelet:
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        self._tasks = [asyncio.create_task(watch(self._client, path, self._on_event)),
                       asyncio.create_task(self._housekeeping(path))]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        for rt in list(self.pods.values()):
            rt.stop.set()
        workers = [rt.task for rt in self.pods.values() if rt.task is not None]
        with contextlib.suppress(Exception):
            await asyncio.gather(*workers, return_exceptions=True)
        for pid in self.live_pids():  # the last net: nothing outlives the harness
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()

    # -- the sync loop --

    async def _on_event(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        rt = self.pods.get(uid)
        if kind == "DELETED" or pod["metadata"].get("deletionTimestamp"):
            if rt is not None:
                rt.stop.set()
            return
        if rt is None:
            if uid in self._done or (pod.get("status") or {}).get("phase") in (
                    "Succeeded", "Failed"):
                return  # a pod runs once: a finished (or late-reported) one is not restarted
            node = (pod.get("spec") or {}).get("nodeName") or ""
            if node not in self.nodes.nodes or self.nodes.lost(node):
                return  # not scheduled yet, or not to a node this kubelet runs
            rt = PodRuntime(uid=uid, name=pod["metadata"]["name"], pod=pod, node=node,
                            lost_nodes=self.nodes)
            self.pods[uid] = rt
            rt.task = asyncio.create_task(self._run(rt))
        else:
            self._seen(rt, pod)
            rt.wake.set()  # e.g. the operator opened the readiness gate

    async def _housekeeping(self, path: str) -> None:
        """A missed DELETED (a dropped watch) must not leave a process running."""
        while True:
            await asyncio.sleep(2)
            with contextlib.suppress(httpx.HTTPError):
                resp = await self._client.get(path)
                if resp.status_code == 200:
                    present = {p["metadata"]["uid"] for p in resp.json().get("items") or []}
                    for uid, rt in list(self.pods.items()):
                        if uid not in present and not rt.stop.is_set() and \
                                await self._gone(path, rt):
                            rt.stop.set()

    async def _gone(self, path: str, rt: PodRuntime) -> bool:
        """Whether the pod is really gone. Absence from a list is not enough: the list is
        the server's state when it was taken, and the watch may have delivered a pod created
        after that before the list's response is read. Stopping that pod would leave it in
        the API, never started again: unready for good, with nothing for the operator to
        do (the one-in-a-few wedge of the e2e scenario). One GET by name settles it."""
        resp = await self._client.get(f"{path}/{rt.name}")
        if resp.status_code == 404:
            return True
        resp.raise_for_status()
        return resp.json()["metadata"]["uid"] != rt.uid

    def _seen(self, rt: PodRuntime, pod: dict[str, Any]) -> None:
        """Keeps the newest version of the pod. The watch and the responses to our own status
        writes arrive on different connections, in either order: the response to a write can
        come back after the watch has already delivered a later change by someone else (the
        operator opening the readiness gate in reaction to that very write). Taking the
        stale response would hide the gate, and with nothing left to change, Ready would never
        be written: the pod stays unready forever. (resourceVersions are the emulator's
        counter; on a real server they are opaque, but this harness only runs on it.)"""
        if _rv(pod) >= _rv(rt.pod):
            rt.pod = pod
        else:
            self.stale_versions += 1

    async def _report(self, rt: PodRuntime) -> None:
        if rt.node_lost:
            return  # nobody is left on that node to report
        desired = podstatus.status(rt.pod, rt.state, rt.phase, _now(), rt.reason, rt.message,
                                   pod_ip=rt.ip)
        if not podstatus.differs(rt.pod.get("status"), desired):
            return
        path = f"/api/v1/namespaces/{self.namespace}/pods/{rt.name}/status"
        resp = await self._client.patch(path, json={"status": desired}, headers=STRATEGIC)
        if resp.status_code == 200:
            self._seen(rt, resp.json())
        elif resp.status_code != 404:
            log.warning("status of %s: HTTP %s %s", rt.name, resp.status_code, resp.text[:200])

    # -- one pod --

    async def _run(self, rt: PodRuntime) -> None:
        try:
            if not await self._prepare_volumes(rt) or not await self._fetch_secrets(rt):
                return
            while not rt.stop.is_set():
                code = await self._run_container(rt)
                if rt.stop.is_set():
                    break
                decision = podstatus.on_exit((rt.pod.get("spec") or {}).get("restartPolicy",
                                                                             "Always"), code)
                if decision == "restart":
                    rt.state = replace(rt.state, waiting_reason="CrashLoopBackOff")
                    await self._report(rt)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(rt.stop.wait(), self.restart_backoff_s)
                    rt.state = replace(rt.state, restart_count=rt.state.restart_count + 1)
                    continue
                rt.phase = decision
                await self._report(rt)
                return
            if rt.final_phase:  # evicted: the pod object stays, Failed
                rt.phase = rt.final_phase
                await self._report(rt)
        except podmap.Unsupported as e:
            rt.state = replace(rt.state, waiting_reason="CreateContainerError")
            rt.reason, rt.message = "Unsupported", str(e)
            log.error("pod %s: %s", rt.name, e)
            await self._report(rt)
        finally:
            if rt.proc is not None and rt.proc.returncode is None:
                await self._terminate(rt, 0)
            self._done.add(rt.uid)
            self.pods.pop(rt.uid, None)
            self.finished.append(rt)

    async def _prepare_volumes(self, rt: PodRuntime) -> bool:
        """Lays out every volume; waits (ContainerCreating) while a ConfigMap is missing."""
        for vol in podmap.volumes(rt.pod).values():
            path = podmap.volume_dir(rt.pod, vol, self.root, self.node_dirs)
            path.mkdir(parents=True, exist_ok=True)
            while vol.kind in ("configMap", "secret"):
                # A missing ConfigMap or Secret volume: the kubelet keeps the pod in
                # ContainerCreating (a FailedMount event), retrying.
                kind = "configmaps" if vol.kind == "configMap" else "secrets"
                resp = await self._client.get(
                    f"/api/v1/namespaces/{self.namespace}/{kind}/{vol.source}")
                if resp.status_code == 200:
                    for key, text in (resp.json().get("data") or {}).items():
                        if vol.kind == "secret":
                            (path / key).write_bytes(base64.b64decode(text))
                            (path / key).chmod(0o400)
                        else:
                            (path / key).write_text(text)
                    break
                if not await self._wait_in(rt, "ContainerCreating"):
                    return False
        return True

    async def _wait_in(self, rt: PodRuntime, reason: str, message: str | None = None) -> bool:
        """Reports the container waiting for `reason` (with the kubelet's `message`) and
        waits half a second before the caller looks again; False once the pod is stopping."""
        rt.state = replace(rt.state, waiting_reason=reason, waiting_message=message)
        await self._report(rt)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(rt.stop.wait(), 0.5)
        return not rt.stop.is_set()

    async def _fetch_secrets(self, rt: PodRuntime) -> bool:
        """Reads the Secret keys the env names, as a kubelet does before it creates the
        container; waits in CreateContainerConfigError while one is missing."""
        for name in podmap.secret_names(rt.pod):
            while True:
                resp = await self._client.get(
                    f"/api/v1/namespaces/{self.namespace}/secrets/{name}")
                data = (resp.json().get("data") or {}) if resp.status_code == 200 else None
                wanted = [(e.get("valueFrom") or {}).get("secretKeyRef") or {}
                          for e in podmap.container(rt.pod).get("env") or []]
                keys = [r.get("key") for r in wanted if r.get("name") == name]
                if data is not None and all(k in data for k in keys):
                    rt.secrets[name] = {k: base64.b64decode(v).decode() for k, v in data.items()}
                    break
                # kubelet_pods.go's words, which the operator reads back.
                missing = next((k for k in keys if data is not None and k not in data), None)
                message = f'secret "{name}" not found' if data is None else \
                    f"couldn't find key {missing} in Secret {self.namespace}/{name}"
                if not await self._wait_in(rt, "CreateContainerConfigError", message):
                    return False
        return True

    async def _run_container(self, rt: PodRuntime) -> int:
        """Starts the process, probes it until it exits or the pod stops; returns the code."""
        ports = podmap.container(rt.pod).get("ports") or []
        rt.port = int(ports[0]["containerPort"]) if ports else 8000
        if rt.ip is None:
            rt.ip = free_pod_ip(rt.port)
        hosts: dict[str, str] = {}
        if self.dns is not None:
            for host, port in podmap.service_hosts(rt.pod):
                address = await self.dns(host, port)
                if address:
                    hosts[f"{host}:{port}"] = address
        pod_dir = self.root / "pods" / rt.uid
        pod_dir.mkdir(parents=True, exist_ok=True)
        termination_log = pod_dir / f"termination-log-{rt.state.restart_count}"
        termination_log.write_bytes(b"")  # a fresh file per container, as the kubelet mounts
        plan = rt.plan = podmap.plan(rt.pod, commands=self.commands, host_port=rt.port,
                                     root=self.root, node_dirs=self.node_dirs,
                                     base_env=self.base_env, pod_ip=rt.ip, hosts=hosts,
                                     secrets=rt.secrets, termination_log=termination_log)
        if podmap.mounts_service_account(rt.pod):
            plan.env.update(podmap.service_account_env(self.api_url, self._service_account(rt)))
        startup = podmap.probe(rt.pod, "startupProbe", rt.port, rt.ip)
        readiness = podmap.probe(rt.pod, "readinessProbe", rt.port, rt.ip)
        log_path = pod_dir / f"container-{rt.state.restart_count}.log"
        rt.logs.append(log_path)
        with log_path.open("wb") as out:
            rt.proc = await asyncio.create_subprocess_exec(
                *plan.argv, env=plan.env, cwd=pod_dir, stdout=out, stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
        rt.pids.append(rt.proc.pid)
        log.info("pod %s: started pid %d on %s:%d", rt.name, rt.proc.pid, rt.ip, rt.port)
        rt.phase = "Running"
        rt.state = replace(rt.state, running=True, started=startup is None, ready=False,
                           failures=0, started_at=_now(), waiting_reason=None,
                           waiting_message=None)
        await self._report(rt)

        exited = asyncio.create_task(rt.proc.wait())
        stopping = asyncio.create_task(rt.stop.wait())
        terminating: asyncio.Task | None = None
        loop = asyncio.get_running_loop()
        next_probe = began = loop.time()
        try:
            while True:
                woken = asyncio.create_task(rt.wake.wait())
                timeout = max(0.0, next_probe - loop.time())
                waiting = {exited, woken} | (set() if stopping.done() else {stopping})
                await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                # Cleared before the report reads rt.pod, never after: a pod change that
                # arrives while we report wakes the next round instead of being dropped.
                rt.wake.clear()
                if exited.done():
                    break
                if stopping.done() and terminating is None:
                    # preStop, SIGTERM, SIGKILL after the grace: meanwhile the container is
                    # still probed and reported, as a kubelet does for a terminating pod (a
                    # draining engine's /ready says 503, and the pod turns unready).
                    grace = 0.0 if rt.kill_now else podmap.grace_period_s(rt.pod)
                    terminating = asyncio.create_task(self._terminate(rt, grace))
                if rt.node_lost:
                    next_probe = loop.time() + 1.0  # frozen: nothing probes, nothing reports
                elif loop.time() >= next_probe:
                    probe = readiness if rt.state.started else startup
                    if probe is not None:
                        # Like the kubelet's prober: one probe per period, counted from the
                        # probe's start, so a probe that times out does not stretch it.
                        probed_at = loop.time()
                        ok = await self._probe(probe)
                        rt.probes.append((round(loop.time() - began, 3), probe.path, ok))
                        if not rt.state.started:
                            rt.state = replace(rt.state, started=ok)
                            next_probe = loop.time() if ok else probed_at + probe.period_s
                        else:
                            rt.state = podstatus.after_probe(rt.state, ok, probe.failure_threshold)
                            next_probe = probed_at + probe.period_s
                    else:  # no readiness probe: ready once started
                        rt.state = replace(rt.state, ready=rt.state.started)
                        next_probe = loop.time() + 1.0
                await self._report(rt)
        finally:
            stopping.cancel()
            if terminating is not None:
                await terminating
        code = await exited
        # A signal death reads as 128+N, as a container runtime reports it.
        code = 128 - code if code < 0 else code
        rt.exit_codes.append(code)
        message = podstatus.termination_message(
            termination_log.read_text(errors="replace"), log_path.read_text(errors="replace"),
            podmap.container(rt.pod).get("terminationMessagePolicy", "File"), code)
        rt.state = replace(rt.state, running=False, started=False, ready=False,
                           last_exit_code=code, last_finished_at=_now(), last_message=message or None)
        log.info("pod %s: pid %d exited %d", rt.name, rt.proc.pid, code)
        return code

    def _service_account(self, rt: PodRuntime) -> Path:
        """The pod's token volume: a token of its own (the emulator checks none, as a cluster
        without authentication would not) and its namespace."""
        path = self.root / "pods" / rt.uid / "serviceaccount"
        path.mkdir(parents=True, exist_ok=True)
        if not (path / "token").exists():
            (path / "token").write_text(f"e2e-{rt.name}-{random.getrandbits(64):016x}")
        (path / "namespace").write_text(self.namespace)
        return path

    async def _probe(self, probe: podmap.Probe) -> bool:
        url = f"http://{probe.host}:{probe.host_port}{probe.path}"
        try:
            resp = await self._client.get(url, timeout=min(1.0, probe.period_s))
            return 200 <= resp.status_code < 400
        except httpx.HTTPError:
            return False

    async def _terminate(self, rt: PodRuntime, grace_s: float) -> None:
        """The preStop sleep, then SIGTERM to the process group, SIGKILL once the grace
        period (which the sleep is part of) is over."""
        proc = rt.proc
        if proc is None or proc.returncode is not None:
            return
        if rt.node_lost or grace_s <= 0:  # the node is gone, or a kill without grace
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            return
        if self.max_grace_s is not None and self._closing:
            grace_s = min(grace_s, self.max_grace_s)
        else:
            pre_stop = min(podmap.pre_stop_sleep_s(rt.pod), grace_s)
            if pre_stop > 0:
                log.info("pod %s: preStop sleep %.0f s", rt.name, pre_stop)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(proc.wait()), pre_stop)
                grace_s -= pre_stop
                if proc.returncode is not None:
                    return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), grace_s)
        except asyncio.TimeoutError:
            log.warning("pod %s: pid %d outlived its %.0f s grace: SIGKILL",
                        rt.name, proc.pid, grace_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


async def _until_stopped(pid: int, timeout: float = 5.0) -> None:
    """Waits until the kernel shows `pid` stopped. A signal takes effect when the process is
    next scheduled, which on a busy machine comes after killpg returns; the node is only
    gone once its engines no longer run."""
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        except (FileNotFoundError, ProcessLookupError):  # gone already, or no /proc here
            return
        await asyncio.sleep(0.01)
