"""Issue 31: the operator checks spec.snapshot.size against what the engines say they need,
in condition SnapshotStorageSufficient. The real kopf operator against the API emulator,
with stand-in engines (fake_engines.py) that publish the engine's real gauges."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from fake_engines import NS, FakeEngines, operator_with_engines

from e2e.waiting import eventually as poll_until
from preheat.operator.kube import Kube
from preheat.operator.resources import INFERENCE_SERVICES, PODS, Resource

EVENTS = Resource("", "v1", "events")
pytestmark = pytest.mark.timeout(90)
HASH = "preheat.dev/template-hash"
# Llama 3 8B in bfloat16 (32 layers x K,V x 8 KV heads x 128 x 2 bytes), default max tokens.
PER_TOKEN, MAX_TOKENS = 32 * 2 * 8 * 128 * 2, 65536
NEEDED = PER_TOKEN * MAX_TOKENS * 5  # 40 GiB: 3 kept + 1 written + 1 fetched


@pytest.fixture
async def cluster(tmp_path, monkeypatch) -> AsyncIterator[tuple[Kube, FakeEngines]]:
    async with operator_with_engines(tmp_path, monkeypatch, resync_seconds=1.0) as both:
        yield both


async def eventually(check: Callable[[], Awaitable[Any]]) -> Any:
    return await poll_until(check, timeout=30.0, interval=0.1)


def service(size: str) -> dict[str, Any]:
    return {
        "apiVersion": "serving.preheat.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": NS},
        "spec": {"model": {}, "engine": {"image": "preheat/engine:dev"}, "replicas": 1,
                 "warmPool": {"size": 0}, "snapshot": {"size": size}, "router": {"enabled": False}},
    }


async def engine_pods(kube: Kube) -> list[dict[str, Any]]:
    return [p for p in await kube.list(PODS, NS, {"preheat.dev/service": "chat"})
            if p["metadata"]["labels"].get("preheat.dev/role") != "router"
            and not p["metadata"].get("deletionTimestamp")]


async def start_engine(engines: FakeEngines, pod: str) -> None:
    """A loaded engine: its gauges set before the kubelet reports it Running with an IP."""
    await engines.start(pod)
    m = engines.metrics[pod]
    m.kv_bytes_per_token.set(PER_TOKEN)
    m.snapshot_max_tokens.set(MAX_TOKENS)
    m.kv_capacity_tokens.set(500_000)
    await engines.ready(pod)


async def condition(kube: Kube) -> tuple[dict[str, Any], dict[str, Any]]:
    st = (await kube.get(INFERENCE_SERVICES, NS, "chat")).get("status") or {}
    c = next((c for c in st.get("conditions") or [] if c["type"] == "SnapshotStorageSufficient"), {})
    return c, st


async def test_a_too_small_snapshot_size_is_false_and_a_big_enough_one_true(cluster):
    kube, engines = cluster
    await kube.create(INFERENCE_SERVICES, NS, service("10Gi"))

    async def one_pod():
        pods = await engine_pods(kube)
        return pods if len(pods) == 1 else None
    [pod] = await eventually(one_pod)

    # No engine has published its bytes per token yet: the operator cannot know.
    async def unknown():
        c, _ = await condition(kube)
        return c if c.get("status") == "Unknown" else None
    assert (await eventually(unknown))["reason"] == "NotReported"

    await start_engine(engines, pod["metadata"]["name"])

    async def too_small():
        c, st = await condition(kube)
        return (c, st) if c.get("status") == "False" else None
    c, st = await eventually(too_small)
    assert c["reason"] == "SnapshotStorageTooSmall"
    assert str(NEEDED) in c["message"] and "10Gi" in c["message"] and "at least 40Gi" in c["message"]
    assert st["snapshotStorage"] == {
        "templateHash": pod["metadata"]["labels"][HASH], "kvBytesPerToken": PER_TOKEN,
        "maxTokens": MAX_TOKENS, "weightCacheBytes": 0, "neededBytes": NEEDED,
        "sizeBytes": 10 * 2**30}
    scraped = engines.scrapes[pod["metadata"]["name"]]

    async def warned():
        events = await kube.list(EVENTS, NS, {})
        return [e for e in events if e.get("reason") == "SnapshotStorageTooSmall"]
    [event] = await eventually(warned)
    assert event["type"] == "Warning" and str(NEEDED) in event["message"]

    # Read once per template: later passes take the numbers from the status.
    await asyncio.sleep(2.5)  # more than two resyncs
    assert engines.scrapes[pod["metadata"]["name"]] == scraped

    # A big enough size: a new pod template (the emptyDir's sizeLimit), asked again.
    await kube.patch(INFERENCE_SERVICES, NS, "chat", {"spec": {"snapshot": {"size": "48Gi"}}})
    old_hash = pod["metadata"]["labels"][HASH]

    async def new_pod():
        new = [p for p in await engine_pods(kube) if p["metadata"]["labels"][HASH] != old_hash]
        return new[0] if new else None
    new = await new_pod() or await eventually(new_pod)
    await start_engine(engines, new["metadata"]["name"])

    async def sufficient():
        c, st = await condition(kube)
        return (c, st) if c.get("status") == "True" else None
    c, st = await eventually(sufficient)
    assert c["reason"] == "Sufficient" and "48Gi" in c["message"]
    assert st["snapshotStorage"]["templateHash"] == new["metadata"]["labels"][HASH]
    assert (st["snapshotStorage"]["neededBytes"], st["snapshotStorage"]["sizeBytes"]) == \
        (NEEDED, 48 * 2**30)
