"""Built-in autoscaling end to end: engine load scales a service up by promotion and back.

An InferenceService with `autoscaling.metric.type: Engine` (preheat_num_requests_running,
target 4 per pod) starts with 1 serving + N warm pods. Many concurrent streaming `openai`
SDK clients then load it through the Service (on the local harness its stand-in,
e2e/service_proxy.py: ready role=serving pods only); the operator reads the load from the
pods' /metrics, scales up, the warm pod is promoted and takes its share; the load stops,
and after the (shortened) scale-down window the service is back at minReplicas — and every
request succeeded.

The clients run in a process of their own, e2e/load_clients.py: in the test's event loop
they would slow the API emulator and the kubelet's probes that share it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e import manifests, scenario
from e2e.load_clients import Load
from e2e.local_cluster import LocalCluster
from e2e.scenario import Timings
from e2e.waiting import eventually
from preheat.operator.resources import CONFIGMAPS, INFERENCE_SERVICES, Resource

ROOT = Path(__file__).resolve().parents[1]
EVENTS = Resource("", "v1", "events")
METRIC = "preheat_num_requests_running"
TARGET_PER_POD = 4  # with 8 sequences per engine (manifests.ENGINE_ENV): half full


def autoscaling(max_replicas: int, down_window_s: int, up_window_s: int = 0) -> dict[str, Any]:
    return {"minReplicas": 1, "maxReplicas": max_replicas,
            "metric": {"type": "Engine", "name": METRIC, "targetAverageValue": TARGET_PER_POD},
            "scaleUpStabilizationSeconds": up_window_s,
            "scaleDownStabilizationSeconds": down_window_s}


class LoadProcess:
    """The clients (e2e/load_clients.py) as a process of their own: see its docstring."""

    def __init__(self, url: str, service: str, clients: int, max_tokens: int) -> None:
        self.args = ["--url", url, "--service", service,
                     "--clients", str(clients), "--max-tokens", str(max_tokens)]
        self._dir = tempfile.TemporaryDirectory(prefix="preheat-load-")
        self.out = Path(self._dir.name) / "load.json"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> float:
        """Starts the clients; returns the (system-wide) monotonic time they started."""
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "e2e.load_clients", *self.args, "--out", str(self.out),
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 120)
        assert line.startswith(b"started "), line
        return float(line.split()[1])

    async def stop(self) -> Load:
        """No new requests; the ones in flight finish; returns what the clients saw."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(self.proc.wait(), 300)
        assert code == 0, f"load clients exited {code}"
        raw = json.loads(self.out.read_text())
        raw["ttft"] = [tuple(x) for x in raw["ttft"]]
        return Load(**raw)

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        self._dir.cleanup()


async def replicas_of(d: LocalCluster, service: str) -> int:
    body = await d.kube.get(INFERENCE_SERVICES, d.namespace, service)
    assert body is not None
    return int(body["spec"]["replicas"])


async def decisions(d: LocalCluster, service: str) -> list[tuple[str, str]]:
    """(reason, message) of the SuccessfulRescale Events on the service, oldest first."""
    events = await d.kube.list(EVENTS, d.namespace, {})
    return [(e.get("reason", ""), e.get("message", "")) for e in events
            if e.get("reason") == "SuccessfulRescale"
            and (e.get("involvedObject") or {}).get("name") == service]


@dataclass
class Outcome:
    timings: Timings
    load: Load
    load_start: float  # monotonic
    second_ready_at: float  # monotonic: the second serving pod Ready
    promoted: bool  # the second serving pod was a warm pod (no process started to serve)
    by_pod: dict[str, int]  # connections (= requests) the Service sent to each pod
    replicas_seen: list[int]  # spec.replicas observed while loaded (flapping shows here)
    statuses: list[dict[str, Any]]  # status.autoscaling whenever its reason changed
    rescales: list[tuple[str, str]]


async def scale_on_load(d: LocalCluster, service: str, *, warm_pool: int, clients: int,
                        max_replicas: int, down_window_s: int, hold_s: float,
                        max_tokens: int = 24, image: str = manifests.DEFAULT_IMAGE,
                        require_no_failures: bool = True,
                        readiness_failure_threshold: int | None = None) -> Outcome:
    """Apply, load, see it scale up (timed from load start to the second Ready serving
    pod), hold the load `hold_s`, stop it, see it back at 1 (timed from the last request's
    end). Asserts no request failed (the benchmark reports failures instead)."""
    t = Timings()
    if await d.kube.get(CONFIGMAPS, d.namespace, manifests.TEMPLATES) is None:
        await d.kube.create(CONFIGMAPS, d.namespace, manifests.warmup_configmap(d.namespace))
    start = time.monotonic()
    # The clients reach the serving pods through the plain Service (router off): this scenario
    # is about the engine-load autoscaler (promotion, no flapping, scale-down) and counts the
    # Service's connections per serving pod; routing is measured by the chaos scenario and
    # benchmarks/routing.py.
    body = manifests.inference_service(
        service, replicas=1, warm_pool=warm_pool, image=image, namespace=d.namespace,
        autoscaling=autoscaling(max_replicas, down_window_s), router=False)
    if readiness_failure_threshold is not None:
        body["spec"]["readiness"]["failureThreshold"] = readiness_failure_threshold
    await d.kube.create(INFERENCE_SERVICES, d.namespace, body)

    async def settled():
        ready = await scenario.ready_by_role(d, service)
        st = await scenario.status_of(d, service)
        return (len(ready["serving"]), len(ready["warm"])) == (1, warm_pool) and \
            (st.get("autoscaling") or {}).get("reportingPods") == 1
    await eventually(settled, scenario.START_TIMEOUT_S, interval=0.2)

    async def routed():  # the Service follows readiness a moment later, as kube-proxy does
        ready = await scenario.ready_by_role(d, service)
        return await d.service_endpoints(service) == set(ready["serving"])
    await eventually(routed, scenario.START_TIMEOUT_S, interval=0.1)
    t["initial_ready_s"] = time.monotonic() - start
    warm_before = set((await scenario.ready_by_role(d, service))["warm"])
    pods_before = {scenario.name_of(p) for p in await scenario.pods_of(d, service)}

    statuses: list[dict[str, Any]] = []
    replicas_seen: list[int] = []

    async def watch_status(stop: asyncio.Event) -> None:
        while not stop.is_set():
            st = (await scenario.status_of(d, service)).get("autoscaling") or {}
            if st and (not statuses or statuses[-1].get("reason") != st.get("reason")):
                statuses.append(dict(st, seen_s=round(time.monotonic() - load_start, 3)))
            await asyncio.sleep(0.1)

    stop_watch = asyncio.Event()
    clients_proc = LoadProcess(await d.service_url(service), service, clients, max_tokens)
    watcher = None
    try:
        load_start = await clients_proc.start()
        watcher = asyncio.create_task(watch_status(stop_watch))
        try:
            async def two_serving():
                return len((await scenario.ready_by_role(d, service))["serving"]) >= 2
            await eventually(two_serving, scenario.START_TIMEOUT_S, interval=0.05)
            second_ready_at = time.monotonic()
            t["load_start_to_second_ready_s"] = second_ready_at - load_start
            serving = set((await scenario.ready_by_role(d, service))["serving"])
            promoted = bool(serving & warm_before) and serving <= pods_before

            hold_end = time.monotonic() + hold_s
            while time.monotonic() < hold_end:
                replicas_seen.append(await replicas_of(d, service))
                await asyncio.sleep(0.25)
        finally:
            load = await clients_proc.stop()
        load_end = load.ended_at
        t["requests_before_scale_up"] = sum(1 for sent, _ in load.ttft if sent < second_ready_at)
        t["load_s"] = load_end - load_start

        async def back_to_min():
            ready = await scenario.ready_by_role(d, service)
            live = [p for p in await scenario.pods_of(d, service) if scenario.is_live(p)
                    and scenario.role_of(p) == "serving"]
            return await replicas_of(d, service) == 1 and len(ready["serving"]) == 1 \
                and len(live) == 1
        await eventually(back_to_min, down_window_s + scenario.START_TIMEOUT_S, interval=0.05)
        t["load_end_to_min_s"] = time.monotonic() - load_end
    finally:
        stop_watch.set()
        if watcher is not None:
            await asyncio.gather(watcher, return_exceptions=True)
        await clients_proc.close()
    if require_no_failures:
        assert load.failed == 0, (load.failed, load.errors[:5])
        assert load.ok == load.sent > 0
    return Outcome(t, load, load_start, second_ready_at, promoted,
                   await d.service_connections(service), replicas_seen, statuses,
                   await decisions(d, service))
