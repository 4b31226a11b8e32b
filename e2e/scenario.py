"""The end-to-end scenario, step by step, against any cluster a Driver gives access to.

Each step asserts what must be true and returns what it measured. The local harness
(e2e/local_cluster.py) and a real cluster (e2e/real_cluster/) implement the Driver.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from e2e import manifests
from e2e.waiting import eventually
from preheat.operator.kube import Kube
from preheat.operator.resources import (
    CONFIGMAPS,
    INFERENCE_SERVICES,
    PDBS,
    PODS,
    PVCS,
    SECRETS,
    SERVICES,
)

# The first engine start on a fresh machine converts the GGUF (~20 s) and several engines
# share two cores: generous bounds for starts, tight ones for what must be fast.
START_TIMEOUT_S = float(os.environ.get("E2E_START_TIMEOUT_S", "240"))
WARM_SCALE_UP_TARGET_S = 2.0


class Driver(Protocol):
    kube: Kube
    namespace: str

    async def endpoint(self, pod: str) -> str: ...  # base URL that reaches the pod's port
    async def crash(self, pod: str) -> None: ...  # kill the engine process of the pod
    async def evict(self, pod: str) -> None: ...
    async def stop_operator(self) -> None: ...
    async def start_operator(self) -> None: ...


# -- reading pods ---------------------------------------------------------------------------

def name_of(pod: dict[str, Any]) -> str:
    return pod["metadata"]["name"]


def role_of(pod: dict[str, Any]) -> str:
    return pod["metadata"]["labels"].get("preheat.dev/role", "")


def condition(pod: dict[str, Any], ctype: str) -> bool:
    return any(c.get("type") == ctype and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def is_live(pod: dict[str, Any]) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and \
        (pod.get("status") or {}).get("phase") not in ("Failed", "Succeeded")


def restarts(pod: dict[str, Any]) -> int:
    return sum(c.get("restartCount", 0)
               for c in (pod.get("status") or {}).get("containerStatuses") or [])


async def all_pods_of(d: Driver, service: str) -> list[dict[str, Any]]:
    """Every pod of the service: engines and routers."""
    return await d.kube.list(PODS, d.namespace, {"preheat.dev/service": service})


async def pods_of(d: Driver, service: str) -> list[dict[str, Any]]:
    """The service's engine pods (serving, warm, draining): not its router pods."""
    return [p for p in await all_pods_of(d, service) if role_of(p) != "router"]


async def routers_ready(d: Driver, service: str, replicas: int = 2) -> dict[str, Any]:
    """Waits until `replicas` router pods are Ready and the Service `<service>` selects
    them (the operator switches it once one is Ready); returns the Service."""
    async def switched():
        ready = [p for p in await all_pods_of(d, service)
                 if role_of(p) == "router" and is_live(p) and condition(p, "Ready")]
        svc = await d.kube.get(SERVICES, d.namespace, service)
        assert len(ready) == replicas, [name_of(p) for p in ready]
        assert svc is not None and svc["spec"]["selector"] == {
            "preheat.dev/service": service, "preheat.dev/role": "router"}, svc and svc["spec"]
        return svc
    return await eventually(switched, START_TIMEOUT_S, interval=0.2)


async def ready_by_role(d: Driver, service: str) -> dict[str, list[str]]:
    """Names of live pods whose Ready condition is True (readiness gate included), by role."""
    out: dict[str, list[str]] = {"serving": [], "warm": []}
    for p in await pods_of(d, service):
        if is_live(p) and condition(p, "Ready"):
            out.setdefault(role_of(p), []).append(name_of(p))
    return out


async def status_of(d: Driver, service: str) -> dict[str, Any]:
    body = await d.kube.get(INFERENCE_SERVICES, d.namespace, service)
    assert body is not None, f"InferenceService {service} is gone"
    return body.get("status") or {}


@dataclass
class Timings:
    values: dict[str, float] = field(default_factory=dict)

    def __setitem__(self, key: str, value: float) -> None:
        self.values[key] = round(value, 3)


# -- steps ----------------------------------------------------------------------------------

async def apply(d: Driver, service: str, *, warm_pool: int = 1, t: Timings,
                image: str = manifests.DEFAULT_IMAGE, api_key: str | None = None,
                router: bool = True) -> None:
    """Applies the template ConfigMap and the InferenceService; waits for 1 ready + N warm
    (and, router True, for its 2 routers behind the Service).
    api_key: the engines require it, handed to them from a Secret (apiKeySecretRef)."""
    if await d.kube.get(CONFIGMAPS, d.namespace, manifests.TEMPLATES) is None:
        await d.kube.create(CONFIGMAPS, d.namespace, manifests.warmup_configmap(d.namespace))
    secret = f"{service}-api-key" if api_key else None
    if secret and await d.kube.get(SECRETS, d.namespace, secret) is None:
        await d.kube.create(SECRETS, d.namespace,
                            manifests.api_key_secret(secret, api_key, d.namespace))
    start = time.monotonic()
    await d.kube.create(INFERENCE_SERVICES, d.namespace, manifests.inference_service(
        service, replicas=1, warm_pool=warm_pool, image=image, namespace=d.namespace,
        api_key_secret=secret, router=router))

    async def settled():
        st = await status_of(d, service)
        assert (st.get("readyReplicas"), st.get("warmReplicas")) == (1, warm_pool), st
        assert st.get("phase") == "Ready", st.get("phase")
        # The status counts a warm pod once its engine is ready; the pod's own Ready
        # condition follows when the operator has opened its gate.
        ready = await ready_by_role(d, service)
        assert (len(ready["serving"]), len(ready["warm"])) == (1, warm_pool), ready
        return st
    st = await eventually(settled, START_TIMEOUT_S, interval=0.2)
    t["initial_ready_s"] = time.monotonic() - start
    conds = {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}
    # Checked below, once the operator has read an engine's bytes per token.
    conds.pop("SnapshotStorageSufficient", None)
    assert conds == {"Ready": ("True", "AllReplicasReady"), "WarmPoolReady": ("True", "PoolFull"),
                     # Pod-local snapshots by default: nothing to bind, works on any storage.
                     "SnapshotVolumeBound": ("True", "PodLocal"),
                     "Degraded": ("False", "AsExpected"),
                     "Progressing": ("True", "RolloutComplete"),
                     "FailoverBackoff": ("False", "NoBackoff"),
                     "ModelUnavailable": ("False", "ModelAvailable")}, conds
    assert {c["observedGeneration"] for c in st["conditions"]} == {1}

    async def snapshot_storage_checked():
        # 1Gi holds the default model's snapshots: 23040 bytes per token (bfloat16) x the
        # 4096-token pool x 5.
        st = await status_of(d, service)
        c = next((c for c in st["conditions"] if c["type"] == "SnapshotStorageSufficient"), {})
        assert (c.get("status"), c.get("reason")) == ("True", "Sufficient"), c
        return st
    await eventually(snapshot_storage_checked, 30, interval=0.2)
    # The children a user sees: the Service selects the routers (spec.router defaults), the
    # headless <service>-engines the serving pods, the engines' budget stays role=serving.
    serving = {"preheat.dev/service": service, "preheat.dev/role": "serving"}
    if router:
        await routers_ready(d, service)
        t["routers_ready_s"] = time.monotonic() - start
        assert (await status_of(d, service))["router"]["summary"] == "2/2"
    else:
        assert (await d.kube.get(SERVICES, d.namespace, service))["spec"]["selector"] == serving
    engines = await d.kube.get(SERVICES, d.namespace, f"{service}-engines")
    assert engines is not None and engines["spec"]["selector"] == serving
    pdb = await d.kube.get(PDBS, d.namespace, service)
    assert pdb is not None and pdb["spec"]["selector"]["matchLabels"]["preheat.dev/role"] == "serving"
    assert await d.kube.get(PVCS, d.namespace, f"{service}-snapshots") is None


async def chat(d: Driver, service: str, t: Timings, n: int = 3,
               api_key: str | None = None) -> list[str]:
    """Chat completions through the serving pod, with the openai SDK (and the engines' API
    key when they have one: a request without it is refused first)."""
    from openai import AsyncOpenAI, AuthenticationError

    [serving] = (await ready_by_role(d, service))["serving"]
    base_url = await d.endpoint(serving) + "/v1"
    client = AsyncOpenAI(base_url=base_url, api_key=api_key or "unused",
                         max_retries=0, timeout=120)
    answers = []
    try:
        if api_key:
            async with AsyncOpenAI(base_url=base_url, api_key="wrong", max_retries=0) as bad:
                try:
                    await bad.models.list()
                    raise AssertionError("the engine served a request without its API key")
                except AuthenticationError:
                    pass
        for i in range(n):
            start = time.monotonic()
            r = await client.chat.completions.create(
                model=service, max_tokens=12, temperature=0,
                messages=[{"role": "user", "content": f"Say hello to customer number {i}."}])
            t[f"chat_{i}_s"] = time.monotonic() - start
            choice = r.choices[0]
            assert choice.finish_reason in ("stop", "length"), choice
            assert choice.message.content and r.usage.completion_tokens > 0, r
            answers.append(choice.message.content)
    finally:
        await client.close()
    return answers


async def chat_through_service(d: Any, service: str, t: Timings, n: int = 4,
                               api_key: str | None = None) -> list[Any]:
    """Chat completions as a client sends them: to the Service, i.e. through a router, each on
    a new connection (a new SDK client), streamed; two turns of one conversation."""
    from openai import AsyncOpenAI

    url = await d.service_url(service)
    replies = []
    for i in range(n):
        async with AsyncOpenAI(base_url=url + "/v1", api_key=api_key or "unused",
                               max_retries=0, timeout=120) as client:
            start = time.monotonic()
            messages = [{"role": "system", "content": "You are a concise support assistant."},
                        {"role": "user", "content": "Where is my order?"}]
            if i % 2:  # the second turn of the same conversation
                messages += [{"role": "assistant", "content": replies[-1]},
                             {"role": "user", "content": "It is NW-20481377."}]
            r = await client.chat.completions.create(model=service, max_tokens=8,
                                                     temperature=0, messages=messages)
            t[f"router_chat_{i}_s"] = time.monotonic() - start
            assert r.choices[0].message.content, r
            replies.append(r.choices[0].message.content)
    return replies


async def scale_up_by_promotion(d: Driver, service: str, t: Timings,
                                target_s: float | None = WARM_SCALE_UP_TARGET_S) -> None:
    """replicas 1 -> 2 through /scale: the warm pod is promoted within seconds, then the
    pool is refilled with a new pod. target_s None: measure only (the cold benchmark)."""
    before = {name_of(p) for p in await pods_of(d, service)}
    warm_before = set((await ready_by_role(d, service))["warm"])
    start = time.monotonic()
    scale = await d.kube.patch(INFERENCE_SERVICES, d.namespace, service,
                               {"spec": {"replicas": 2}}, subresource="scale")
    assert scale is not None and scale["spec"]["replicas"] == 2

    async def two_serving():
        return len((await ready_by_role(d, service))["serving"]) == 2
    await eventually(two_serving, START_TIMEOUT_S, interval=0.02)
    t["scale_up_second_ready_s"] = time.monotonic() - start
    serving = set((await ready_by_role(d, service))["serving"])
    if warm_before:
        # From the warm pool: no pod was created to serve, the warm one was relabelled.
        assert serving <= before and serving & warm_before, (serving, before, warm_before)
        if target_s is not None:
            assert t.values["scale_up_second_ready_s"] <= target_s, t.values

    async def pool_refilled():
        ready = await ready_by_role(d, service)
        return len(ready["warm"]) == len(warm_before) and len(ready["serving"]) == 2
    await eventually(pool_refilled, START_TIMEOUT_S, interval=0.1)
    t["pool_refilled_s"] = time.monotonic() - start

    async def status_follows():
        st = await status_of(d, service)
        return (st.get("replicas"), st.get("readyReplicas"), st.get("warmReplicas")) == \
            (2, 2, len(warm_before))
    await eventually(status_follows, 15)


async def restart_operator_during_eviction(d: Driver, service: str, t: Timings) -> None:
    """The operator crashes; meanwhile a serving pod is evicted. The restarted operator,
    with no memory of its past, replaces it by promoting the warm pod and refills the pool
    with exactly one new pod: never a duplicate."""
    pods = {name_of(p): p for p in await pods_of(d, service) if is_live(p)}
    ready = await ready_by_role(d, service)
    assert (len(ready["serving"]), len(ready["warm"])) == (2, 1), ready
    [warm] = ready["warm"]
    victim = sorted(ready["serving"])[0]
    await d.stop_operator()
    await d.evict(victim)
    start = time.monotonic()
    await d.start_operator()

    seen_live: set[str] = set()
    most_live = 0

    async def healed():
        nonlocal most_live
        current = await pods_of(d, service)
        live = [name_of(p) for p in current if is_live(p)]
        seen_live.update(live)
        most_live = max(most_live, len(live))
        r = await ready_by_role(d, service)
        return len(r["serving"]) == 2 and len(r["warm"]) == 1 and \
            victim not in {name_of(p) for p in current}
    await eventually(healed, START_TIMEOUT_S, interval=0.05)
    t["operator_restart_healed_s"] = time.monotonic() - start
    ready = await ready_by_role(d, service)
    assert warm in ready["serving"], ("the warm pod was not promoted", ready)
    created = seen_live - set(pods)
    assert len(created) == 1, ("exactly one backfill pod", created)
    assert most_live <= 3, ("more pods than replicas + pool at some point", most_live)

    # Stable: a few resync periods later, the same pods.
    names = sorted(name_of(p) for p in await pods_of(d, service))
    await asyncio.sleep(5)
    assert sorted(name_of(p) for p in await pods_of(d, service)) == names


async def crash_serving_engine(d: Driver, service: str, t: Timings) -> None:
    """Kill a serving pod's engine process while a warm pod is ready: once the pod has been
    unready for spec.failover.unreadySeconds, the warm pod is promoted and the crashed pod
    deleted (failover); the pool is refilled with one new pod. The time until the serving
    capacity is back is measured (benchmarks/results/chaos.md holds the measured numbers)."""
    spec = (await d.kube.get(INFERENCE_SERVICES, d.namespace, service))["spec"]
    replicas = spec["replicas"]
    ready = await ready_by_role(d, service)
    assert len(ready["serving"]) == replicas and ready["warm"], ready
    [victim, *_] = sorted(ready["serving"])
    warm = set(ready["warm"])
    before = {name_of(p) for p in await pods_of(d, service)}
    start = time.monotonic()
    await d.crash(victim)

    async def went_unready():
        return victim not in (await ready_by_role(d, service))["serving"]
    await eventually(went_unready, 30, interval=0.05)
    t["crash_unready_s"] = time.monotonic() - start

    async def capacity_back():
        r = await ready_by_role(d, service)
        return len(r["serving"]) == replicas and victim not in r["serving"]
    await eventually(capacity_back, START_TIMEOUT_S, interval=0.05)
    t["crash_capacity_back_s"] = time.monotonic() - start
    serving = set((await ready_by_role(d, service))["serving"])
    assert serving & warm, ("a warm pod took over", serving, warm)

    async def pool_refilled():
        pods = {name_of(p) for p in await pods_of(d, service)}
        r = await ready_by_role(d, service)
        return victim not in pods and len(r["warm"]) == len(warm) and \
            len(r["serving"]) == replicas and len(pods - before) == 1
    await eventually(pool_refilled, START_TIMEOUT_S, interval=0.1)
    t["crash_pool_refilled_s"] = time.monotonic() - start


async def delete_everything(d: Driver, service: str, t: Timings) -> None:
    """Deleting the InferenceService removes every child it owns."""
    start = time.monotonic()
    await d.kube.delete(INFERENCE_SERVICES, d.namespace, service)

    async def gone():
        return (await d.kube.get(INFERENCE_SERVICES, d.namespace, service) is None
                and not await all_pods_of(d, service)
                and await d.kube.get(SERVICES, d.namespace, service) is None
                and await d.kube.get(PVCS, d.namespace, f"{service}-snapshots") is None)
    await eventually(gone, 60, interval=0.1)
    t["delete_children_gone_s"] = time.monotonic() - start
