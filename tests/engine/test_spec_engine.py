"""Speculative decoding through the engine, in float32 on tiny random-weight models and the
embedded model: greedy output with `speculative_method="ngram"` is token for token the
output without it (through prefix-cache hits, chunked prefill, preemption, penalties, logit
bias, grammars, stop strings, logprobs), rejected drafts leave no trace in the KV that the
radix tree caches, and sampling keeps the non-speculative distribution.

A 64-token vocabulary makes a random model repeat itself, so the real n-gram drafter finds
drafts; an oracle drafter (the known greedy continuation, whole, cut, or wrong) drives every
acceptance case on purpose."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from test_fault_containment import run as run_to_end

from preheat.engine import LLM, SamplingParams
from preheat.engine.kv.prefix_io import read_pages
from preheat.engine.request.sampling_params import StructuredOutput

SMALL_VOCAB = 64  # the small_vocab_* fixtures' vocabulary (tests/engine/conftest.py)


def small_prompts(seed: int) -> list[list[int]]:
    """Mixed lengths; three share a prefix that spans pages."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(17, SMALL_VOCAB, (21,), generator=g).tolist()
    prompts = [shared + torch.randint(17, SMALL_VOCAB, (n,), generator=g).tolist() for n in (1, 9, 30)]
    prompts += [torch.randint(17, SMALL_VOCAB, (n,), generator=g).tolist() for n in (3, 50)]
    return prompts


def spec_llm(model_dir: Path, **kw) -> LLM:
    """These tests are about verifying drafts: every match is verified (`always`) unless a
    test asks for the gate, whose decisions rest on measured step times."""
    kw.setdefault("page_size", 4)
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("speculative_gate", "always")
    return LLM(model=str(model_dir), dtype="float32", speculative_method="ngram", **kw)


class OracleDrafter:
    """Drafts from the known greedy continuation of each prompt: whole (accepted with a
    bonus token), wrong from a random position on (accepted in part), or wrong throughout."""

    def __init__(self, prompts: Sequence[list[int]], outputs: Sequence[list[int]], vocab: int, seed: int = 0) -> None:
        self.full = [list(p) + list(o) for p, o in zip(prompts, outputs)]
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.calls = 0

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        self.calls += 1
        full = next((f for f in self.full if f[: len(token_ids)] == token_ids), None)
        if full is None:  # the output already left the greedy path: the test fails anyway
            return [1] * num_tokens
        draft = full[len(token_ids) : len(token_ids) + num_tokens]
        mode = self.rng.random()
        if mode < 0.4 or not draft:
            return draft
        cut = 0 if mode > 0.8 else self.rng.randrange(len(draft))
        return draft[:cut] + [(t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab for t in draft[cut:]]


def assert_cached_kv_is_verified(llm: LLM, model_dir: Path) -> None:
    """Every prefix the radix tree caches holds the KV a fresh, non-speculative prefill of
    its tokens computes: no rejected draft's KV was ever cached."""
    engine = llm.engine
    leaves = [n for n in engine.radix.nodes() if not n.children]
    assert leaves
    ref = LLM(model=str(model_dir), dtype="float32", page_size=engine.pool.page_size, max_total_tokens=4096)
    for leaf in leaves:
        tokens = engine.radix.path_tokens(leaf)
        ref.generate([tokens + [tokens[0]]], SamplingParams(max_tokens=1, temperature=0))
        match = ref.engine.radix.match_prefix(tokens, touch=False)
        assert match.length == len(tokens)
        got = read_pages(engine.pool, engine.radix.path_pages(leaf))
        want = read_pages(ref.engine.pool, list(match.pages))
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("model_fixture", ["small_vocab_llama_dir", "small_vocab_qwen2_dir"])
def test_ngram_greedy_equals_greedy_without_speculation(model_fixture, request) -> None:
    model_dir = request.getfixturevalue(model_fixture)
    prompts = small_prompts(0)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = LLM(model=str(model_dir), dtype="float32", page_size=4, max_total_tokens=4096, chunked_prefill_size=24)
    expected = [r.token_ids for r in plain.generate(prompts, params)]

    llm = spec_llm(model_dir, chunked_prefill_size=24, prompt_lookup_min=1, num_speculative_tokens=3)
    first = llm.generate(prompts, params)
    second = llm.generate(prompts, params)  # from the radix cache, which speculation filled
    assert [r.token_ids for r in first] == expected
    assert [r.token_ids for r in second] == expected
    stats = llm.engine.stats()
    assert stats.spec_draft_tokens_total > 0 and 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total
    assert stats.generation_tokens_total == 2 * sum(len(e) for e in expected)
    assert llm.engine.pool.num_used_pages == llm.engine.radix.total_pages  # nothing leaked
    assert_cached_kv_is_verified(llm, model_dir)


def test_the_gate_stays_exact_and_verifies_right_drafts_but_not_wrong_ones(small_vocab_llama_dir) -> None:
    """`--speculative-gate auto`: the greedy output is the plain one whatever it decides; with
    drafts that are always right it verifies them, with drafts that are never right it soon
    stops (the cost of a draft token is pinned here: the decision, not this machine's
    timing, is under test)."""
    prompts = small_prompts(4)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = LLM(model=str(small_vocab_llama_dir), dtype="float32", page_size=4, max_total_tokens=4096)
    expected = [r.token_ids for r in plain.generate(prompts, params)]

    llm = spec_llm(small_vocab_llama_dir, speculative_gate="auto", num_speculative_tokens=4)
    spec = llm.engine.speculator
    spec.costs.costs = lambda batch: (0.3, 0.3)  # (kappa, sigma)
    spec.drafter = OracleDrafter(prompts, expected, SMALL_VOCAB, seed=4)
    spec.drafter.rng.random = lambda: 0.0  # whole, right drafts
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected
    right = llm.engine.stats()
    assert right.spec_accepted_tokens_total == right.spec_draft_tokens_total > right.generation_tokens_total / 2

    wrong = OracleDrafter(prompts, expected, SMALL_VOCAB, seed=5)
    wrong.rng.random = lambda: 0.9  # wrong throughout
    spec.drafter = wrong
    spec.acceptance = type(spec.acceptance)(4, spec.gate.global_decay)  # forget the right ones
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected
    stats = llm.engine.stats()
    drafted = stats.spec_draft_tokens_total - right.spec_draft_tokens_total
    steps = max(len(e) for e in expected)
    assert 0 < drafted < 4 * len(prompts) * steps / 4  # tried at first, then stepped aside
    assert wrong.calls < len(prompts) * steps  # and only looked up now and then
    assert llm.engine.pool.num_used_pages == llm.engine.radix.total_pages


def test_oracle_drafts_accepted_whole_in_part_or_not_at_all_stay_exact_under_preemption(small_vocab_llama_dir) -> None:
    prompts = small_prompts(1)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = LLM(model=str(small_vocab_llama_dir), dtype="float32", page_size=4, max_total_tokens=4096)
    expected = [r.token_ids for r in plain.generate(prompts, params)]

    # 40 pages of 4 tokens cannot hold all five sequences to the end: drafts are dropped
    # and sequences preempted as the pool fills.
    llm = spec_llm(small_vocab_llama_dir, max_total_tokens=160, chunked_prefill_size=32, num_speculative_tokens=5)
    llm.engine.speculator.drafter = OracleDrafter(prompts, expected, SMALL_VOCAB)
    results = llm.generate(prompts, params)
    assert [r.token_ids for r in results] == expected
    stats = llm.engine.stats()
    assert stats.preemptions_total > 0
    # Whole drafts were accepted: far fewer steps than tokens.
    assert stats.spec_accepted_tokens_total > stats.generation_tokens_total / 3
    assert stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total
    assert llm.engine.pool.num_used_pages == llm.engine.radix.total_pages
    assert_cached_kv_is_verified(llm, small_vocab_llama_dir)


def test_without_radix_cache_rejected_draft_pages_go_back(small_vocab_qwen2_dir) -> None:
    prompts = small_prompts(2)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain = LLM(model=str(small_vocab_qwen2_dir), dtype="float32", page_size=4, disable_radix_cache=True)
    expected = [r.token_ids for r in plain.generate(prompts, params)]
    llm = spec_llm(small_vocab_qwen2_dir, disable_radix_cache=True, num_speculative_tokens=8)
    llm.engine.speculator.drafter = OracleDrafter(prompts, expected, SMALL_VOCAB, seed=3)
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected
    assert llm.engine.pool.num_used_pages == 0


SAMPLING_CASES = {
    "penalties": SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5,
        presence_penalty=0.4,
    ),
    "logit_bias": SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logit_bias={33: 4.0, 40: -100}),
    "logprobs": SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=3),
    "regex": SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, structured=StructuredOutput("regex", r"([0-9]+,)+[0-9]+;"),
    ),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampling_features_stay_exact_with_several_tokens_per_step(case: str, small_vocab_llama_dir) -> None:
    params = SAMPLING_CASES[case]
    prompts = small_prompts(3)
    plain = LLM(model=str(small_vocab_llama_dir), dtype="float32", page_size=4, max_total_tokens=4096)
    want = plain.generate(prompts, params)
    expected = [r.token_ids for r in want]
    llm = spec_llm(small_vocab_llama_dir, num_speculative_tokens=4)
    llm.engine.speculator.drafter = OracleDrafter(prompts, expected, SMALL_VOCAB, seed=5)
    got = llm.generate(prompts, params)
    assert [r.token_ids for r in got] == expected
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert llm.engine.stats().spec_accepted_tokens_total > 0
    if params.logprobs is not None:
        for g, w in zip(got, want):
            assert [lp.token_id for lp in g.logprobs] == [lp.token_id for lp in w.logprobs]
            assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)
            assert [[t for t, _ in lp.top] for lp in g.logprobs] == [[t for t, _ in lp.top] for lp in w.logprobs]
    if params.structured is not None:
        assert any(r.finish_reason == "stop" for r in got)  # some grammars completed mid-step


def test_stop_strings_and_stop_ids_cut_a_multi_token_step_where_decoding_would(small_vocab_llama_dir) -> None:
    prompts = small_prompts(4)
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = LLM(model=str(small_vocab_llama_dir), dtype="float32", page_size=4, max_total_tokens=4096)
    full = [r.token_ids for r in plain.generate(prompts, free)]
    tok = plain.tokenizer
    # A stop string from the middle of the first output, a stop id from the second's.
    stop_text = tok.decode(full[0][12:14])
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop_text]),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[full[1][17]]),
    ] + [free] * (len(prompts) - 2)
    want = plain.generate(prompts, params)
    assert want[0].finish_reason == "stop" and want[1].finish_reason == "stop"
    llm = spec_llm(small_vocab_llama_dir, num_speculative_tokens=6)
    llm.engine.speculator.drafter = OracleDrafter(prompts, full, SMALL_VOCAB, seed=7)
    got = llm.generate(prompts, params)
    assert [(r.token_ids, r.text, r.finish_reason) for r in got] == [
        (r.token_ids, r.text, r.finish_reason) for r in want
    ]
    assert llm.engine.pool.num_used_pages == llm.engine.radix.total_pages
    assert_cached_kv_is_verified(llm, small_vocab_llama_dir)


def test_warmup_runs_the_speculative_path_and_leaves_nothing_behind(small_vocab_llama_dir, monkeypatch) -> None:
    from preheat.engine import runner as runner_module

    drafted_batches: list[int] = []
    real_verify = runner_module.verify_drafts

    def counting_verify(logits, rows, drafts, masks=None, *rest):
        drafted_batches.append(len(rows))
        return real_verify(logits, rows, drafts, masks, *rest)

    monkeypatch.setattr(runner_module, "verify_drafts", counting_verify)
    llm = spec_llm(small_vocab_llama_dir, max_num_seqs=3)
    assert drafted_batches == [1, 2]  # 4 > --max-num-seqs
    engine = llm.engine
    assert engine.spec_warmup_seconds > 0
    assert engine.pool.num_used_pages == 0 and engine.radix.total_pages == 0
    stats = engine.stats()
    assert stats.spec_draft_tokens_total == 0 and stats.generation_tokens_total == 0


# --- a drafted request fails alone ---------------------------------------------------------------


def spec_fault_setup(model_dir: Path, base: str):
    """Three greedy requests with oracle drafts (so every step verifies drafts) and their
    outputs without speculation."""
    prompts = small_prompts(6)[:3]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM(model=str(model_dir), dtype="float32", page_size=4, max_total_tokens=4096)
    expected = [r.token_ids for r in plain.generate(prompts, params)]
    llm = spec_llm(model_dir, num_speculative_tokens=4)
    llm.engine.speculator.drafter = OracleDrafter(prompts, expected, SMALL_VOCAB, seed=9)
    seqs = [llm.engine.build_sequence(p, params, f"{base}-{i}") for i, p in enumerate(prompts)]
    return llm, seqs, expected


def assert_victim_alone_failed(llm, finals, seqs, expected, victim, stage: str) -> None:
    out = finals[victim.request_id]
    assert out.finish_reason == "error" and stage in out.error, out
    for seq, want in zip(seqs, expected):
        if seq is not victim:
            assert finals[seq.request_id].finish_reason == "length"
            assert finals[seq.request_id].token_ids == want  # still exact: drafts kept being verified
    engine = llm.engine
    assert not engine.running and not engine.waiting
    assert engine.pool.num_used_pages == engine.radix.total_pages  # its pages went back
    assert engine.stats().failed_total == 1


def test_a_draft_verification_that_raises_fails_only_that_request(small_vocab_llama_dir, monkeypatch) -> None:
    from preheat.engine import runner as runner_module

    llm, seqs, expected = spec_fault_setup(small_vocab_llama_dir, "verify")
    victim = seqs[1]
    real_verify = runner_module.verify_drafts

    def verify(logits, rows, drafts, masks=None, *rest):
        if any(r is victim for r in rows) and len(victim.output_token_ids) >= 5:
            raise RuntimeError("verifier exploded")
        return real_verify(logits, rows, drafts, masks, *rest)

    monkeypatch.setattr(runner_module, "verify_drafts", verify)
    finals = run_to_end(llm.engine, seqs)
    assert_victim_alone_failed(llm, finals, seqs, expected, victim, "verifying its draft")
    assert "verifier exploded" in finals[victim.request_id].error
    assert llm.engine.stats().spec_accepted_tokens_total > 0


def test_a_detokenizer_that_raises_mid_draft_fails_only_its_request(small_vocab_llama_dir) -> None:
    llm, seqs, expected = spec_fault_setup(small_vocab_llama_dir, "detok")
    victim = seqs[2]
    real_add = victim.detokenizer.add

    def add(token_id: int) -> None:
        if len(victim.output_token_ids) >= 6:  # within a step that appends several tokens
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_add(token_id)

    victim.detokenizer.add = add
    finals = run_to_end(llm.engine, seqs)
    assert_victim_alone_failed(llm, finals, seqs, expected, victim, "detokenizing")


# --- sampling keeps its distribution ------------------------------------------------------------


class GreedyDrafter:
    """Drafts the model's own most likely continuation (computed by transformers), so drafts
    are accepted often and rejected sometimes: both branches of speculative sampling run."""

    def __init__(self, hf_model, vocab: int) -> None:
        self.hf = hf_model
        self.cache: dict[tuple[int, ...], list[int]] = {}

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        key = tuple(token_ids)
        if key not in self.cache:
            ids = list(token_ids)
            for _ in range(num_tokens):
                with torch.no_grad():
                    ids.append(int(self.hf(torch.tensor([ids])).logits[0, -1].argmax()))
            self.cache[key] = ids[len(token_ids) :]
        return self.cache[key][:num_tokens]


def exact_joint(hf_model, prompt: list[int], depth: int, top_k: int, temperature: float) -> dict[tuple, float]:
    """P(x1..x_depth) of non-speculative sampling with top-k and temperature, from the model."""
    out: dict[tuple, float] = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, p in out.items():
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt + list(prefix)])).logits[0, -1] / temperature
            values, ids = logits.topk(top_k)
            probs = values.softmax(-1)
            for t, q in zip(ids.tolist(), probs.tolist()):
                nxt[prefix + (t,)] = p * q
        out = nxt
    return out


def test_speculative_sampling_keeps_the_distribution_of_plain_sampling(small_vocab_llama_dir) -> None:
    """The first three of four sampled tokens (top-3 of a 64-token vocabulary: 27 outcomes),
    2000 requests with fixed seeds: their empirical distribution is within a total-variation
    bound of the exact non-speculative one. Deterministic, with a margin: sampling noise
    gives TV ~0.04 here (plain sampling: 0.038, speculative: 0.043), while a sampler that
    always kept the draft is off by 0.77 and one that resampled from p instead of the
    residual after a rejection by 0.30."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(small_vocab_llama_dir, dtype=torch.float32)
    prompt = small_prompts(5)[3]
    temperature, top_k, n = 1.5, 3, 2000
    exact = exact_joint(hf, prompt, 3, top_k, temperature)

    llm = spec_llm(small_vocab_llama_dir, max_num_seqs=256, num_speculative_tokens=2, seed=11)
    llm.engine.speculator.drafter = GreedyDrafter(hf, SMALL_VOCAB)
    # Four tokens: after the first, drafts of two are verified (both positions' rules run).
    params = SamplingParams(max_tokens=4, temperature=temperature, top_k=top_k, ignore_eos=True)
    results = llm.generate([prompt] * n, params)
    counts: dict[tuple, int] = {}
    for r in results:
        counts[tuple(r.token_ids[:3])] = counts.get(tuple(r.token_ids[:3]), 0) + 1
    assert set(counts) <= set(exact)  # nothing outside the top-k paths
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    stats = llm.engine.stats()
    assert stats.spec_draft_tokens_total >= n  # every request verified drafts...
    assert 0.2 < stats.spec_accepted_tokens_total / stats.spec_draft_tokens_total < 0.95  # ...kept and refused
    assert tv < 0.1, f"total variation {tv:.3f}"


@pytest.mark.slow
def test_embedded_smollm2_greedy_equals_greedy_without_speculation() -> None:
    prompts_text = [
        "Repeat this sentence three times: the red bicycle is parked by the old bakery.",
        "List the numbers from 1 to 20, separated by commas.",
    ]
    plain = LLM(dtype="float32", max_total_tokens=2048, page_size=16)
    tok = plain.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False))
        for t in prompts_text
    ]
    params = SamplingParams(max_tokens=48, temperature=0)
    expected = [r.token_ids for r in plain.generate(prompts, params)]
    del plain
    # every match verified: in float32 a draft's extend costs the torch path most of a step,
    # and on these answers the gate (`auto`) rightly leaves drafting off
    llm = LLM(dtype="float32", max_total_tokens=2048, page_size=16, speculative_method="ngram",
              speculative_gate="always")
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens_total > 0  # real text repeats: some drafts are kept
