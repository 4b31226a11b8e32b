"""PENDING (engine/engine.py is the lead's): fails until Engine._views fills in
SeqView.cached_evictable_pages. Not collected by pytest (name); run it by path."""

from __future__ import annotations

from pathlib import Path

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
