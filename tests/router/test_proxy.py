"""The proxy shell against real engines (two tiny-model `preheat serve` processes) and the
failure states a dying engine shows: retried before the first byte, never after it."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest
from faulty_engines import stand_in
from openai import AsyncOpenAI
from router_engines import TINY
from router_server import running_router
from serve_process import free_port

from preheat.router.config import RouterConfig
from preheat.router.discovery import Endpoints
from preheat.router.policy import ranking
from preheat.router.prefix import request_key

CFG = RouterConfig(service="chat", retry_deadline=10.0)


def conversation(i: int, *turns: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": f"You help customer {i} of the store."}]
    for j, t in enumerate(turns):
        msgs.append({"role": "user" if j % 2 == 0 else "assistant", "content": t})
    return msgs


def endpoints(ready: dict[str, str]) -> Endpoints:
    e = Endpoints()
    e.replace(ready)
    return e


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
                f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def keys_ranked_first(pods: list[str], first: str, n: int) -> list[int]:
    """Conversation numbers whose prefix ranks `first` at the top of `pods`."""
    found = []
    for i in itertools.count():
        key = request_key({"model": TINY, "messages": conversation(i, "hi")}, CFG.affinity_chars)
        if ranking(key, pods)[0] == first:
            found.append(i)
            if len(found) == n:
                return found
    raise AssertionError


async def test_a_conversation_streams_through_and_its_turns_stay_on_one_engine(engines):
    ready = {"e0": engines[0].url, "e1": engines[1].url}
    async with running_router(CFG, endpoints=endpoints(ready)) as (url, _), \
            AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        for i in range(4):
            raw = await client.chat.completions.with_raw_response.create(
                model=TINY, messages=conversation(i, "Where is my order?"), max_tokens=6,
                temperature=0)
            first, engine = raw.parse(), raw.headers["x-preheat-engine"]
            answer = first.choices[0].message.content
            # The second turn resends the first: its engine has it cached.
            second = await client.chat.completions.create(
                model=TINY, messages=conversation(i, "Where is my order?", answer, "And now?"),
                max_tokens=6, temperature=0)
            assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
            raw = await client.chat.completions.with_raw_response.create(
                model=TINY, messages=conversation(i, "Where is my order?"), max_tokens=1)
            assert raw.headers["x-preheat-engine"] == engine  # where the conversation lives
            # Streamed: chunks arrive one by one, not as one buffered body.
            chunks = [c async for c in await client.chat.completions.create(
                model=TINY, messages=conversation(i, "Where is my order?"), max_tokens=6,
                temperature=0, stream=True)]
            assert len(chunks) >= 3
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
        text = (await httpx.AsyncClient().get(url + "/metrics")).text
    # Every later request of a conversation went to its pod, and both pods got some (a first
    # turn may have been placed off its top-ranked pod: bounded load, before any prefix).
    routed = [metric(text, "preheat_router_routed_total", reason=r) for r in ("affinity", "spill")]
    assert sum(routed) == 16 and routed[0] >= 12
    assert metric(text, "preheat_router_prefix_routed_total", held="true") == 12
    assert metric(text, "preheat_router_requests_total", pod="e0", outcome="2xx") > 0
    assert metric(text, "preheat_router_requests_total", pod="e1", outcome="2xx") > 0
    assert metric(text, "preheat_router_retries_total") == 0


async def test_two_routers_share_where_they_placed_a_conversation(engines):
    """Router 1 places a conversation off its top-ranked pod (bounded load); its next turn
    reaches router 2, which has learned that from router 1 — without it, it would pick the
    top-ranked pod, where the conversation's prefix is not."""
    ready = {"e0": engines[0].url, "e1": engines[1].url}
    cfg = RouterConfig(service="chat", retry_deadline=10.0, balance_factor=1.0, balance_slack=0,
                       share_interval=0.1)
    eps1, eps2 = endpoints(ready), endpoints(ready)
    a, b = keys_ranked_first(sorted(ready), "e0", 2)
    async with running_router(cfg, endpoints=eps1) as (url1, _), \
            running_router(cfg, endpoints=eps2) as (url2, _), \
            AsyncOpenAI(base_url=url1 + "/v1", api_key="x", max_retries=0, timeout=60) as one, \
            AsyncOpenAI(base_url=url2 + "/v1", api_key="x", max_retries=0, timeout=60) as two, \
            httpx.AsyncClient(timeout=10) as http:
        eps1.peers, eps2.peers = {"r2": url2}, {"r1": url1}
        engines_of = []
        for i in (a, b):  # both rank e0 first; the bar (mean, no slack) puts b on e1
            raw = await one.chat.completions.with_raw_response.create(
                model=TINY, messages=conversation(i, "hi"), max_tokens=2)
            engines_of.append(raw.headers["x-preheat-engine"])
        assert engines_of == ["e0", "e1"]

        async def learned() -> float:
            return metric((await http.get(url2 + "/metrics")).text,
                          "preheat_router_placements_learned_total")
        deadline = asyncio.get_running_loop().time() + 10
        while await learned() < 2:
            assert asyncio.get_running_loop().time() < deadline, "router 2 never learned"
            await asyncio.sleep(0.05)
        raw = await two.chat.completions.with_raw_response.create(
            model=TINY, messages=conversation(b, "hi", "hello", "and?"), max_tokens=2)
        assert raw.headers["x-preheat-engine"] == "e1"
        assert raw.parse().usage.prompt_tokens_details.cached_tokens > 0
        # The journal is for the peers only.
        eps2.peers = {}
        resp = await http.get(url2 + "/router/placements")
        assert resp.status_code == 403


async def test_a_refused_or_draining_pod_is_retried_on_another_before_any_byte(engines):
    async with stand_in("draining") as (draining_url, drained):
        ready = {"dead": f"http://127.0.0.1:{free_port()}", "draining": draining_url,
                 "e0": engines[0].url}
        pods = sorted(ready)
        picks = keys_ranked_first(pods, "dead", 2) + keys_ranked_first(pods, "draining", 2)
        async with running_router(CFG, endpoints=endpoints(ready)) as (url, _), \
                AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
            for i in picks:
                stream = await client.chat.completions.create(
                    model=TINY, messages=conversation(i, "hi"), max_tokens=4, stream=True)
                assert [c async for c in stream]
            text = (await httpx.AsyncClient().get(url + "/metrics")).text
    assert len(drained) >= 2
    assert metric(text, "preheat_router_retries_total", pod="dead", reason="connect") >= 2
    assert metric(text, "preheat_router_retries_total", pod="draining", reason="unavailable") >= 2
    assert metric(text, "preheat_router_requests_total", pod="e0", outcome="2xx") == 4
    assert metric(text, "preheat_router_unroutable_total") == 0


async def test_a_stream_broken_after_its_first_byte_is_not_retried_and_not_made_whole():
    async with stand_in("breaks") as (broken_url, connections):
        async with running_router(CFG, endpoints=endpoints({"broken": broken_url})) as (url, _), \
                httpx.AsyncClient(timeout=10) as http:
            got = b""
            with pytest.raises(httpx.HTTPError):
                async with http.stream("POST", url + "/v1/chat/completions", json={
                        "model": TINY, "messages": conversation(0, "hi"), "stream": True}) as resp:
                    assert resp.status_code == 200
                    async for chunk in resp.aiter_bytes():
                        got += chunk
            text = (await http.get(url + "/metrics")).text
    assert b"first" in got  # the byte that reached the client...
    assert len(connections) == 1  # ...so no second attempt anywhere
    assert metric(text, "preheat_router_requests_total", pod="broken", outcome="aborted") == 1


async def test_admin_routes_are_never_proxied(engines):
    async with running_router(CFG, endpoints=endpoints({"e0": engines[0].url})) as (url, _), \
            httpx.AsyncClient(timeout=10) as http:
        for path in ("/admin/snapshot", "/admin/save", "/admin"):
            resp = await http.post(url + path)
            assert resp.status_code == 404 and "router" in resp.json()["error"]["message"]
        text = (await http.get(url + "/metrics")).text
    assert metric(text, "preheat_router_requests_total") == 0


async def test_with_no_ready_pod_a_request_waits_for_one_within_the_deadline(engines):
    eps = endpoints({})
    async with running_router(CFG, endpoints=eps) as (url, _), \
            httpx.AsyncClient(timeout=30) as http:
        ready = await http.get(url + "/ready")
        assert ready.status_code == 200 and ready.json()["engines"] == []
        pending = asyncio.create_task(http.post(url + "/v1/completions", json={
            "model": TINY, "prompt": "Hello", "max_tokens": 3}))
        await asyncio.sleep(0.5)
        assert not pending.done()
        eps.update("e1", engines[1].url)  # e.g. a warm pod promoted after a failover
        resp = await pending
        assert resp.status_code == 200 and resp.json()["choices"]
    short = RouterConfig(service="chat", retry_deadline=0.5)
    async with running_router(short, endpoints=endpoints({})) as (url, _), \
            httpx.AsyncClient(timeout=30) as http:
        resp = await http.post(url + "/v1/completions", json={"model": TINY, "prompt": "x"})
        assert resp.status_code == 503 and "no engine" in resp.json()["error"]["message"]
        assert metric((await http.get(url + "/metrics")).text, "preheat_router_unroutable_total") == 1


async def test_the_engines_load_gauges_under_vllms_names_follow_a_routed_stream(engines):
    """What the Gateway API Inference Extension's endpoint picker and KEDA recipes read."""
    async with running_router(CFG, endpoints=endpoints({"e0": engines[0].url})) as (url, _), \
            AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as client, \
            httpx.AsyncClient(timeout=10) as http:
        stream = await client.completions.create(model=TINY, prompt="Once upon a time",
                                                 max_tokens=200, stream=True,
                                                 extra_body={"ignore_eos": True})
        seen = []
        async for _ in stream:
            if not seen:  # mid-stream: the engine is running this request
                text = (await http.get(engines[0].url + "/metrics")).text
                seen.append((metric(text, "vllm:num_requests_running"),
                             metric(text, "preheat_num_requests_running"),
                             metric(text, "vllm:kv_cache_usage_perc"),
                             metric(text, "preheat_kv_cache_usage_ratio")))
        text = (await http.get(engines[0].url + "/metrics")).text
    [(running, ours, usage, our_usage)] = seen
    assert running == ours == 1 and usage == our_usage and 0 < usage <= 1
    assert metric(text, "vllm:num_requests_running") == 0
    assert metric(text, "vllm:num_requests_waiting") == metric(text, "preheat_num_requests_waiting") == 0
