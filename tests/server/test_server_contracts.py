"""The server's own contracts, on a fake engine (no model, milliseconds): the OpenAPI
document names the real request models, a request failing inside the engine is a 500 for
that request only, a full queue is a 429 with Retry-After, /admin/snapshot is single-flight."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from fake_engine import FakeEngine

from preheat.engine.async_engine import AsyncEngine
from preheat.engine.metrics import Metrics
from preheat.engine.peer.peer_secret import PeerKeys
from preheat.engine.request.limits import MAX_N, MAX_STOP, SAMPLING_BOUNDS
from preheat.engine.serve.server import create_app
from preheat.engine.warm.snapshot_peer import MIN_SAVE_INTERVAL_S
from preheat.engine.warm.snapshotter import SavedSnapshot, Snapshotter


class StaticSecret:
    def __init__(self, key: bytes) -> None:
        self._keys = PeerKeys(key, (key,))

    def keys(self) -> PeerKeys:
        return self._keys


PEER = StaticSecret(b"contracts-peer-secret-0123")


@pytest.fixture
async def served():
    """A ready AsyncEngine on a FakeEngine and an HTTP client for its app."""

    async def make(engine=None, **app_kwargs):
        aengine = AsyncEngine(Metrics(), engine or FakeEngine())
        aengine.start(asyncio.get_running_loop())
        aengine.set_phase("ready")
        app = create_app(aengine, **app_kwargs)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        made.append((aengine, client))
        return aengine, client

    made: list = []
    yield make
    for aengine, client in made:
        await client.aclose()
        aengine.stop()


async def test_the_openapi_document_names_the_request_models_with_their_ranges(served):
    _, http = await served()
    doc = (await http.get("/openapi.json")).json()
    routes = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest",
              "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}
    schemas = doc["components"]["schemas"]
    for path, model in routes.items():
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert model in schemas
    chat = schemas["ChatCompletionRequest"]["properties"]
    temperature = [s for s in chat["temperature"]["anyOf"] if s.get("type") == "number"][0]
    assert temperature["maximum"] == SAMPLING_BOUNDS["temperature"].hi
    assert chat["n"]["maximum"] == MAX_N
    assert chat["messages"]["maxItems"] > 0
    stop_list = [s for s in chat["stop"]["anyOf"] if s.get("type") == "array"][0]
    assert stop_list["maxItems"] == MAX_STOP
    assert "$ref" in json.dumps(chat["messages"])  # ChatMessage, resolvable:
    assert "ChatMessage" in schemas
    r = await http.get("/docs")
    assert r.status_code == 200 and "swagger" in r.text.lower() and "/openapi.json" in r.text


async def test_a_request_that_fails_in_the_engine_is_a_500_for_it_alone(served):
    aengine, http = await served(FakeEngine(fail_token=13))
    good = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 4}
    bad = {**good, "prompt": [1, 13, 3]}
    results = await asyncio.gather(http.post("/v1/completions", json=bad), http.post("/v1/completions", json=good))
    failed, ok = results
    assert failed.status_code == 500, failed.text
    err = failed.json()["error"]
    assert err["code"] == "request_failed" and "injected" in err["message"]
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    # A stream has answered 200 already: the failure is its error event.
    async with http.stream("POST", "/v1/completions", json={**bad, "stream": True}) as r:
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_failed"
    assert (await http.get("/health")).status_code == 200 and aengine.error is None
    assert aengine.metrics.requests.labels(finish_reason="error")._value.get() == 2


async def test_a_full_queue_is_a_429_with_retry_after(served):
    fake = FakeEngine()
    fake.max_queue_len = 2
    _, http = await served(fake)
    body = {"model": "fake", "prompt": [[1, 2], [3, 4], [5, 6]], "max_tokens": 4}
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "rate_limit_error"
    assert (await http.post("/v1/completions", json={**body, "prompt": [[1, 2]]})).status_code == 200


async def test_admin_snapshot_is_single_flight(served, tmp_path):
    snapshotter = Snapshotter(str(tmp_path), 1024, 0, Metrics())
    started, release = threading.Event(), threading.Event()

    def slow_save(aengine, engine, limit=None):
        started.set()
        assert release.wait(30)
        return SavedSnapshot(str(tmp_path / "snap"), 16, 1, 0.1)

    snapshotter._save = slow_save
    _, http = await served(snapshotter=snapshotter, peer_secret=PEER)
    http.headers["Authorization"] = f"Bearer {PEER.keys().current.decode()}"
    first = asyncio.ensure_future(http.post("/admin/snapshot"))
    await asyncio.to_thread(started.wait, 30)
    second = await http.post("/admin/snapshot")
    assert second.status_code == 409 and second.json()["error"]["code"] == "snapshot_in_progress"
    assert not first.done()
    release.set()
    r = await first
    assert r.status_code == 200 and r.json()["tokens"] == 16
    release.clear()
    started.clear()
    release.set()
    # Free again afterwards, but not at once: a forced save right after one is a 429.
    soon = await http.post("/admin/snapshot")
    assert soon.status_code == 429 and soon.json()["error"]["code"] == "snapshot_too_soon"
    assert int(soon.headers["retry-after"]) >= 1
    snapshotter._last_forced -= MIN_SAVE_INTERVAL_S  # as if that long had passed
    assert (await http.post("/admin/snapshot")).status_code == 200
