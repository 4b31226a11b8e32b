"""Backpressure in the engine: a bounded waiting line (--max-queue-len) and a waiting line
that costs the step loop nothing beyond the admission window (counted, not timed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from preheat.engine import LLM, SamplingParams
from preheat.engine.request.errors import QueueFull, RequestRejected

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)


def test_a_request_that_would_overfill_the_queue_is_refused_whole(tiny_llama_dir: Path) -> None:
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=512, max_queue_len=3)
    engine = llm.engine
    seqs = [engine.build_sequence(list(range(100 + i, 110 + i)), PARAMS) for i in range(4)]
    engine.enqueue_all(seqs[:2])
    with pytest.raises(QueueFull) as info:
        engine.enqueue_all(seqs[2:])  # 2 + 2 > 3: neither is queued
    assert info.value.status == 429 and info.value.retry_after > 0 and info.value.code == "queue_full"
    assert engine.stats().num_waiting == 2
    engine.enqueue_all(seqs[2:3])
    while engine.has_unfinished():
        engine.step()
    engine.enqueue_all(seqs[3:])  # room again once the line drained
    # The Python API's batches are not a server queue: enqueue() is never refused.
    assert len(llm.generate([list(range(300 + i, 305 + i)) for i in range(8)], PARAMS)) == 8


def test_the_request_prompt_token_budget_is_the_engines(tiny_llama_dir: Path) -> None:
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_total_tokens=512, max_request_prompt_tokens=100)
    llm.engine.check_request_budget(100)
    with pytest.raises(RequestRejected) as info:
        llm.engine.check_request_budget(101, "messages")
    assert (info.value.code, info.value.param, info.value.status) == ("request_too_large", "messages", 400)


def test_waiting_requests_beyond_the_admission_window_cost_no_prefix_match(tiny_llama_dir: Path, monkeypatch) -> None:
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=2048, max_num_seqs=2)
    engine = llm.engine
    matches = []
    real_peek = engine.kv.peek_prefix

    def counting_peek(tokens):
        matches.append(len(tokens))
        return real_peek(tokens)

    monkeypatch.setattr(engine.kv, "peek_prefix", counting_peek)
    for i in range(200):
        engine.add_request(list(range(1000 + i, 1012 + i)), PARAMS)
    per_step = []
    finished = 0
    while engine.has_unfinished():
        before = len(matches)
        window = engine.scheduler.admission_window()  # what the coming step may look at
        finished += sum(o.finished for o in engine.step())
        per_step.append(len(matches) - before)
        assert per_step[-1] <= window <= 2 * engine.config.max_num_seqs
    assert finished == 200  # nobody starves behind the window
    # 200 waiting requests, yet no step matched more than 4 of them (2 free slots x 2).
    assert max(per_step) == 4 and sum(per_step) < 200 * 4
