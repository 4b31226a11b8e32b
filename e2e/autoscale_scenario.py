"""Built-in autoscaling end to end: engine load scales a service up by promotion and back.

An InferenceService with `autoscaling.metric.type: Engine` (preheat_num_requests_running,
target 4 per pod) starts with 1 serving + N warm pods. Many concurrent streaming `openai`
SDK clients then load it through a Router that stands in for the Service; the operator
reads the load from the pods' /metrics, scales up, the warm pod is promoted and takes its
share; the load stops, and after the (shortened) scale-down window the service is back at
minReplicas — and every request succeeded.

Router (HARNESS code, a stand-in for the Service and kube-proxy, which the local harness
does not have): it lists the pods every 0.2 s and sends each new request to a random pod
whose Ready condition is True and whose role is serving — the Service's endpoints rule.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from e2e import manifests, scenario
from e2e.scenario import Driver, Timings
from e2e.waiting import eventually
from preheat.operator.resources import CONFIGMAPS, INFERENCE_SERVICES, Resource

EVENTS = Resource("", "v1", "events")
METRIC = "preheat_num_requests_running"
TARGET_PER_POD = 4  # with 8 sequences per engine (manifests.ENGINE_ENV): half full


def autoscaling(max_replicas: int, down_window_s: int, up_window_s: int = 0) -> dict[str, Any]:
    return {"minReplicas": 1, "maxReplicas": max_replicas,
            "metric": {"type": "Engine", "name": METRIC, "targetAverageValue": TARGET_PER_POD},
            "scaleUpStabilizationSeconds": up_window_s,
            "scaleDownStabilizationSeconds": down_window_s}


class Router:
    """Sends each request to a random Ready serving pod (see the module docstring)."""

    def __init__(self, d: Driver, service: str) -> None:
        self.d, self.service = d, service
        self.endpoints: list[str] = []
        self._task: asyncio.Task | None = None

    async def refresh(self) -> None:
        names = (await scenario.ready_by_role(self.d, self.service))["serving"]
        self.endpoints = [await self.d.endpoint(n) for n in sorted(names)]

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            try:
                await self.refresh()
            except Exception:  # a pod that went away between the list and the lookup
                pass

    async def __aenter__(self) -> Router:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()

    def pick(self) -> str | None:
        """A Ready serving pod's URL; None when there is none (a Service without endpoints:
        the request fails, as a client's connection would)."""
        return random.choice(self.endpoints) if self.endpoints else None


@dataclass
class Load:
    """What the clients saw: every request counts, none is retried (max_retries=0)."""
    sent: int = 0
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (sent at, TTFT s)
    by_endpoint: dict[str, int] = field(default_factory=dict)
    ended_at: float | None = None  # monotonic time the last request finished


async def run_clients(router: Router, service: str, clients: int, stop: asyncio.Event,
                      load: Load, max_tokens: int = 24) -> None:
    """`clients` concurrent streaming chat clients, each sending back to back until stop."""
    from openai import AsyncOpenAI

    sdk: dict[str, AsyncOpenAI] = {}

    def client_for(url: str) -> AsyncOpenAI:
        if url not in sdk:
            sdk[url] = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                   timeout=120)
        return sdk[url]

    async def one_client(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            url = router.pick()
            load.sent += 1
            if url is None:
                load.failed += 1
                load.errors.append("no Ready serving pod (the Service has no endpoints)")
                await asyncio.sleep(0.2)
                continue
            load.by_endpoint[url] = load.by_endpoint.get(url, 0) + 1
            start = time.monotonic()
            first = None
            tokens, finish = 0, None
            try:
                stream = await client_for(url).chat.completions.create(
                    model=service, max_tokens=max_tokens, temperature=0.7, stream=True,
                    messages=[{"role": "user",
                               "content": f"Customer {i}-{n} asks: where is my parcel?"}])
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        tokens += 1
                        first = first or time.monotonic()
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                if finish not in ("stop", "length") or tokens == 0:
                    raise RuntimeError(f"incomplete stream: finish={finish} tokens={tokens}")
                load.ok += 1
                load.ttft.append((start, (first or time.monotonic()) - start))
            except Exception as e:  # every failure counts, whatever its kind
                load.failed += 1
                load.errors.append(f"{url}: {type(e).__name__}: {e}"[:300])

    try:
        await asyncio.gather(*(one_client(i) for i in range(clients)))
    finally:
        load.ended_at = time.monotonic()
        for c in sdk.values():
            await c.close()


async def replicas_of(d: Driver, service: str) -> int:
    body = await d.kube.get(INFERENCE_SERVICES, d.namespace, service)
    assert body is not None
    return int(body["spec"]["replicas"])


async def decisions(d: Driver, service: str) -> list[tuple[str, str]]:
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
    replicas_seen: list[int]  # spec.replicas observed while loaded (flapping shows here)
    statuses: list[dict[str, Any]]  # status.autoscaling whenever its reason changed
    rescales: list[tuple[str, str]]


async def scale_on_load(d: Driver, service: str, *, warm_pool: int, clients: int,
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
    body = manifests.inference_service(
        service, replicas=1, warm_pool=warm_pool, image=image, namespace=d.namespace,
        autoscaling=autoscaling(max_replicas, down_window_s))
    if readiness_failure_threshold is not None:
        body["spec"]["readiness"]["failureThreshold"] = readiness_failure_threshold
    await d.kube.create(INFERENCE_SERVICES, d.namespace, body)

    async def settled():
        ready = await scenario.ready_by_role(d, service)
        st = await scenario.status_of(d, service)
        return (len(ready["serving"]), len(ready["warm"])) == (1, warm_pool) and \
            (st.get("autoscaling") or {}).get("reportingPods") == 1
    await eventually(settled, scenario.START_TIMEOUT_S, interval=0.2)
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

    load, stop_load, stop_watch = Load(), asyncio.Event(), asyncio.Event()
    async with Router(d, service) as router:
        load_start = time.monotonic()
        clients_task = asyncio.create_task(
            run_clients(router, service, clients, stop_load, load, max_tokens))
        watcher = asyncio.create_task(watch_status(stop_watch))
        try:
            async def two_serving():
                return len((await scenario.ready_by_role(d, service))["serving"]) >= 2
            await eventually(two_serving, scenario.START_TIMEOUT_S, interval=0.05)
            second_ready_at = time.monotonic()
            t["load_start_to_second_ready_s"] = second_ready_at - load_start
            serving = set((await scenario.ready_by_role(d, service))["serving"])
            promoted = bool(serving & warm_before) and serving <= pods_before
            t["requests_before_scale_up"] = load.sent

            hold_end = time.monotonic() + hold_s
            while time.monotonic() < hold_end:
                replicas_seen.append(await replicas_of(d, service))
                await asyncio.sleep(0.25)
        finally:
            stop_load.set()
            await clients_task
        load_end = load.ended_at or time.monotonic()
        t["load_s"] = load_end - load_start

        async def back_to_min():
            ready = await scenario.ready_by_role(d, service)
            live = [p for p in await scenario.pods_of(d, service) if scenario.is_live(p)
                    and scenario.role_of(p) == "serving"]
            return await replicas_of(d, service) == 1 and len(ready["serving"]) == 1 \
                and len(live) == 1
        await eventually(back_to_min, down_window_s + scenario.START_TIMEOUT_S, interval=0.05)
        t["load_end_to_min_s"] = time.monotonic() - load_end
        stop_watch.set()
        await watcher
    if require_no_failures:
        assert load.failed == 0, (load.failed, load.errors[:5])
        assert load.ok == load.sent > 0
    return Outcome(t, load, load_start, second_ready_at, promoted, replicas_seen, statuses,
                   await decisions(d, service))
