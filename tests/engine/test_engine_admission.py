"""Admission through the real engine on a tiny model: what the planner's pure decisions
(tests/engine/test_scheduler.py) add up to once the prefix cache and the pool are real."""

from __future__ import annotations

from pathlib import Path

import pytest

from preheat.engine import LLM, SamplingParams


def test_admitting_a_cached_prefix_never_preempts_a_running_decode(tiny_llama_dir: Path) -> None:
    # 10 pages of 4. A's 16 tokens stay cached (4 evictable pages); D runs until its next
    # token needs a fresh page while none is free. W shares A's prefix and needs 1 page.
    # Counting A's pages as free headroom admits W, whose admission locks them: D then finds
    # nothing to evict and is preempted (24 tokens recomputed) for a request that should wait.
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=40)
    engine = llm.engine
    a = list(range(1000, 1016))
    llm.generate(a, SamplingParams(max_tokens=1, ignore_eos=True))
    engine.add_request(list(range(2000, 2020)), SamplingParams(max_tokens=12, ignore_eos=True, temperature=0))
    while not engine.running or engine.running[0].num_computed < 24:
        engine.step()
    assert engine.pool.num_free_pages == 0 and engine.radix is not None and engine.radix.evictable_pages == 4
    engine.add_request(a + [5, 6, 7, 8], SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().preemptions_total == 0


def test_a_burst_sharing_an_uncached_prefix_computes_it_once(tiny_llama_dir: Path) -> None:
    # Four requests arrive together with one 64-token system prompt nobody has computed.
    # The first computes it; the others wait one step and find it in the prefix cache
    # instead of each computing it again in the same step.
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=2048)
    system = list(range(3000, 3064))
    prompts = [system + [10 + i, 20 + i, 30 + i] for i in range(4)]
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)
    results = llm.generate(prompts, params)
    assert [r.cached_tokens for r in results] == [0, 64, 64, 64]
    stats = llm.engine.stats()
    assert stats.prompt_tokens_total - stats.cached_tokens_total == 64 + 4 * 3


@pytest.mark.parametrize("radix, admitted_first", [(True, 1), (False, 3)])
def test_only_with_the_prefix_cache_does_a_sharer_wait(tiny_llama_dir: Path, radix, admitted_first) -> None:
    # Without a prefix cache there is nothing to wait for: all three start at once.
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=2048,
              disable_radix_cache=not radix)
    engine = llm.engine
    system = list(range(3000, 3064))
    for i in range(3):
        engine.add_request(system + [10 + i], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    assert len(engine.running) == admitted_first
    while engine.has_unfinished():
        engine.step()
