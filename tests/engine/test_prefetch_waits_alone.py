"""A request whose prefix is being fetched from L3 waits alone: the running streams keep
getting decode steps meanwhile (counted, no clocks), and `timeout` recomputes for that
request only. The L3 disk is made slow by a gate (a fault injection: its reads block until
the test opens it), so "still waiting" is a fact, not a race."""

from __future__ import annotations

import threading

import pytest
import torch

from preheat.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0)
LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
STEPS_WHILE_WAITING = 10


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 49000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def gate_l3(llm: LLM) -> threading.Event:
    """Every L3 read blocks until the returned event is set."""
    gate = threading.Event()
    l3 = llm.engine.tiers.l3
    read = l3.get

    def slow_get(key):
        gate.wait(120)
        return read(key)

    l3.get = slow_get
    return gate


def setup(tiny_llama_dir, tmp_path, policy: str, **extra):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=1024,
              disk_cache_dir=str(tmp_path / "l3"), prefetch_policy=policy, **extra)
    cold = prompt(7, 48)
    reference = llm.generate([cold], GREEDY)[0]
    radix = llm.engine.radix
    radix.evict(radix.total_pages)  # every page of it now only on disk
    return llm, cold, reference


def run_beside_two_streams(llm: LLM, cold: list[int], steps: int) -> tuple[str, dict[str, int], list]:
    """Starts two long streams, then the L3 request; steps `steps` times. Returns the L3
    request's id, the tokens each stream got during those steps, and every output."""
    engine = llm.engine
    streams = [engine.add_request(prompt(s, 20), LONG) for s in (1, 2)]
    for _ in range(3):  # both admitted and decoding
        engine.step()
    waiting = engine.add_request(cold, GREEDY)
    got = dict.fromkeys(streams, 0)
    outs = []
    for _ in range(steps):
        for out in engine.step():
            outs.append(out)
            if out.request_id in got:
                got[out.request_id] += len(out.new_token_ids)
    return waiting, got, outs


def finish(llm: LLM, rid: str):
    for _ in range(500):
        for out in llm.engine.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError("the request never finished")


@pytest.mark.parametrize("with_l2", [False, True])
def test_wait_complete_keeps_the_batch_decoding_while_one_request_waits_on_a_slow_disk(
    tiny_llama_dir, tmp_path, with_l2
):
    llm, cold, reference = setup(tiny_llama_dir, tmp_path, "wait_complete",
                                 **({"host_cache_size": 0.00001} if with_l2 else {}))
    gate = gate_l3(llm)
    try:
        rid, got, outs = run_beside_two_streams(llm, cold, STEPS_WHILE_WAITING)
        # Every step decoded both streams; the L3 request produced nothing and still waits.
        assert list(got.values()) == [STEPS_WHILE_WAITING] * 2, got
        assert not any(o.request_id == rid for o in outs)
        assert [s.request_id for s in llm.engine.waiting] == [rid]
    finally:
        gate.set()
    out = finish(llm, rid)
    assert out.token_ids == reference.token_ids
    assert out.cached_tokens >= 44  # all whole pages came back from disk, not recomputed
    hits = llm.engine.tier_hit_tokens
    assert hits["l3"] > 0 and hits["l2"] + hits["l3"] >= 44


def test_timeout_recomputes_for_that_request_only_and_the_streams_never_wait(tiny_llama_dir, tmp_path):
    llm, cold, reference = setup(tiny_llama_dir, tmp_path, "timeout", prefetch_timeout_ms=0.0)
    gate = gate_l3(llm)
    try:
        rid, got, outs = run_beside_two_streams(llm, cold, STEPS_WHILE_WAITING)
        assert list(got.values()) == [STEPS_WHILE_WAITING] * 2, got
        # Past its deadline at once, it started without its disk pages (recomputing them).
        assert any(o.request_id == rid for o in outs)
        out = finish(llm, rid) if not any(o.request_id == rid and o.finished for o in outs) else \
            next(o for o in outs if o.request_id == rid and o.finished)
        assert out.token_ids == reference.token_ids
        assert out.cached_tokens == 0 and llm.engine.tier_hit_tokens["l3"] == 0
    finally:
        gate.set()
