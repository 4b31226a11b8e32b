"""A request can fail, the engine cannot: faults injected into one request's admission,
inputs, sampling or detokenizing end that request (finish_reason "error", its pages freed)
while the others finish; a failing KV tier (a full disk) is a cache miss. Only the forward
pass may raise out of step()."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from preheat.engine import LLM, SamplingParams
from preheat.engine.kv.tiers import DiskPageStore
from preheat.engine.metrics import Metrics

PARAMS = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=1024)


def prompts(n: int, base: int = 1000) -> list[list[int]]:
    return [list(range(base + 100 * i, base + 100 * i + 9)) for i in range(n)]


def run(engine, seqs) -> dict:
    """Queues the sequences and steps until all are finished; returns the final outputs."""
    for seq in seqs:
        engine.enqueue(seq)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def build(engine, n: int, base: int = 1000, params: SamplingParams = PARAMS) -> list:
    return [engine.build_sequence(p, params, f"r{base}-{i}") for i, p in enumerate(prompts(n, base))]


def assert_only_victim_failed(engine, finals, victim, others, stage: str) -> None:
    assert finals[victim.request_id].finish_reason == "error"
    assert stage in finals[victim.request_id].error
    for seq in others:
        out = finals[seq.request_id]
        assert out.finish_reason == "length" and len(out.token_ids) == PARAMS.max_tokens, out
    assert engine.kv.all_free(), "the failed request's pages were not given back"
    assert not engine.running and not engine.waiting


def test_a_sampler_that_raises_for_one_request_fails_only_that_request(llm, monkeypatch):
    engine = llm.engine
    seqs = build(engine, 3)
    victim = seqs[1]
    from preheat.engine import runner as runner_module

    real = runner_module.sample

    def sample(logits, rows, grammar_masks=None, *rest):
        if any(r is victim for r in rows) and len(victim.output_token_ids) >= 3:
            raise RuntimeError("sampler exploded")
        return real(logits, rows, grammar_masks, *rest)

    monkeypatch.setattr(runner_module, "sample", sample)
    failed_before = engine.stats().failed_total
    finals = run(engine, seqs)
    assert_only_victim_failed(engine, finals, victim, [seqs[0], seqs[2]], "sampling")
    assert "sampler exploded" in finals[victim.request_id].error
    assert len(finals[victim.request_id].token_ids) == 3  # what it had before the fault
    assert engine.stats().failed_total == failed_before + 1
    # The engine serves on: the same prompt again, with the fault gone.
    monkeypatch.setattr(runner_module, "sample", real)
    assert llm.generate(prompts(1)[0], PARAMS)[0].finish_reason == "length"


def test_a_detokenizer_that_raises_fails_only_its_request(llm):
    engine = llm.engine
    seqs = build(engine, 3, base=5000)
    victim = seqs[0]

    def add(token_id: int) -> None:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    victim.detokenizer.add = add
    finals = run(engine, seqs)
    assert_only_victim_failed(engine, finals, victim, seqs[1:], "detokenizing")
    assert "UnicodeDecodeError" in finals[victim.request_id].error


def test_a_request_whose_inputs_cannot_be_prepared_fails_alone(llm, monkeypatch):
    engine = llm.engine
    seqs = build(engine, 3, base=9000)
    victim = seqs[2]
    real_grow = engine.kv.grow

    def grow(seq, num_pages):
        if seq is victim and seq.output_token_ids:  # a bookkeeping bug: no page after all
            return True
        return real_grow(seq, num_pages)

    monkeypatch.setattr(engine.kv, "grow", grow)
    finals = run(engine, seqs)
    assert_only_victim_failed(engine, finals, victim, seqs[:2], "preparing its inputs")


def test_an_admission_that_raises_fails_only_that_request(llm, monkeypatch):
    engine = llm.engine
    seqs = build(engine, 3, base=13000)
    victim = seqs[1]
    real_admit = engine.kv.admit

    def admit(seq):
        if seq is victim:
            raise RuntimeError("tier index corrupt")
        return real_admit(seq)

    monkeypatch.setattr(engine.kv, "admit", admit)
    finals = run(engine, seqs)
    assert_only_victim_failed(engine, finals, victim, [seqs[0], seqs[2]], "admitting")


def test_a_failing_forward_pass_is_the_one_thing_that_raises_out_of_step(llm, monkeypatch):
    engine = llm.engine
    engine.add_request(prompts(1, 17000)[0], PARAMS)

    def forward(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(engine.model, "forward", forward)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.step()
    monkeypatch.undo()
    engine.abort_request(engine.running[0].request_id)
    engine.step()
    assert not engine.has_unfinished()


def test_full_disk_under_eviction_pressure_is_a_miss_counted_not_a_crash(tiny_llama_dir, tmp_path, monkeypatch):
    """The issue's repro: only --disk-cache-dir set (no L2), so every evicted page is written
    straight to L3; ENOSPC there used to raise into the step loop and kill the engine."""
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=128,
              disk_cache_dir=str(tmp_path / "l3"))
    engine = llm.engine
    assert engine.tiers is not None and engine.tiers.l2 is None

    def full(self, key, kv):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskPageStore, "_write", full)
    g = torch.Generator().manual_seed(7)
    batches = [[torch.randint(3, 49000, (40,), generator=g).tolist() for _ in range(2)] for _ in range(4)]
    for batch in batches:  # each batch evicts the previous one's cached pages
        for result in llm.generate(batch, PARAMS):
            assert result.finish_reason == "length" and len(result.token_ids) == PARAMS.max_tokens
    errors = engine.tiers.error_counts()
    assert errors[("l3", "write")] > 0
    assert not any((tmp_path / "l3").rglob("*.safetensors"))
    metrics = Metrics()
    metrics.record_tiers(engine)
    assert metrics.kv_tier_errors.labels(tier="l3", op="write")._value.get() == errors[("l3", "write")]
    assert "preheat_kv_tier_errors_total{" in metrics.render()[0].decode()


def test_an_unreadable_l3_page_is_a_miss_counted_as_a_read_error(tiny_llama_dir, tmp_path, monkeypatch):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=512,
              disk_cache_dir=str(tmp_path / "l3"), prefetch_policy="wait_complete")
    engine = llm.engine
    prompt = prompts(1, 21000)[0] * 4
    reference = llm.generate(prompt, PARAMS)[0]
    engine.radix.evict(engine.radix.total_pages)
    assert any((tmp_path / "l3").rglob("*.safetensors"))

    from preheat.engine.kv import tiers

    def unreadable(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(tiers, "safe_open", unreadable)
    again = llm.generate(prompt, PARAMS)[0]
    assert again.token_ids == reference.token_ids and again.cached_tokens == 0  # recomputed
    assert engine.tiers.error_counts()[("l3", "read")] >= 1
