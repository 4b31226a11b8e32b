"""Speculative decoding without a model: the n-gram drafter, the acceptance rules (greedy
agreement; speculative sampling that preserves the target distribution, checked on a tiny
vocabulary with a fixed seed), the sampler's per-position processing of a draft, the
grammar masks along a draft, and the planner's pages for draft tokens."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from preheat.engine.request.sampling_params import SamplingParams
from preheat.engine.sample.sampler import sample, verify_drafts
from preheat.engine.sample.spec_decode import (
    NgramIndex,
    accept_greedy,
    accept_sampled,
    draft_limit,
    propose_ngram,
)
from preheat.engine.sched.plan import SeqView, plan_step

# --- drafting ---------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6]
    # last two tokens (5, 6) occur at 0 and 5; the latest is 5, followed by 7, 1, 5, 6
    assert propose_ngram(tokens, 3, 1, 2) == [7, 1, 5]
    assert propose_ngram(tokens, 10, 1, 2) == [7, 1, 5, 6]  # only what exists
    # the longest n-gram wins: (1, 5, 6) never occurred before, (5, 6) did
    assert propose_ngram(tokens, 2, 2, 3) == [7, 1]


def test_ngram_prefers_the_longest_matching_window() -> None:
    # (3, 4) last occurred at 6 -> [9]; the 3-gram (2, 3, 4) occurred at 1 -> [5, 6]
    tokens = [1, 2, 3, 4, 5, 6, 3, 4, 9, 2, 3, 4]
    assert propose_ngram(tokens, 2, 2, 3) == [5, 6]
    assert propose_ngram(tokens, 2, 2, 2) == [9, 2]


def test_ngram_proposes_nothing_without_a_match_or_room() -> None:
    assert propose_ngram([1, 2, 3, 4], 4, 1, 3) == []  # 4 never occurred before
    assert propose_ngram([1, 2, 1, 2], 4, 3, 3) == []  # no earlier 3-gram (2, 1, 2)
    assert propose_ngram([1, 2, 1, 2], 0, 1, 3) == []
    assert propose_ngram([7], 4, 1, 1) == []
    assert propose_ngram([7, 7], 4, 1, 1) == [7]
    assert propose_ngram([1, 2, 1, 2], 4, 2, 2) == [1, 2]


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=60),  # 4 symbols: n-grams repeat often
    cuts=st.lists(st.integers(0, 60), max_size=6),
    lookup=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    num_tokens=st.integers(0, 6),
)
def test_the_ngram_index_proposes_what_a_full_lookup_proposes(
    tokens: list[int], cuts: list[int], lookup: tuple[int, int], num_tokens: int
) -> None:
    """An index fed the tokens in arbitrary chunks proposes, after each chunk, exactly what
    propose_ngram proposes over the whole context so far."""
    lo, hi = lookup[0], lookup[0] + lookup[1]
    index = NgramIndex(lo, hi)
    assert index.propose(num_tokens) == propose_ngram([], num_tokens, lo, hi) == []
    for a, b in itertools.pairwise([0, *sorted(c for c in cuts if c <= len(tokens)), len(tokens)]):
        index.extend(tokens[a:b])
        assert index.length == b
        assert index.propose(num_tokens) == propose_ngram(tokens[:b], num_tokens, lo, hi)


def test_draft_limit_keeps_the_request_within_its_length() -> None:
    assert draft_limit(4, num_tokens=10, max_total_tokens=100) == 4
    assert draft_limit(4, num_tokens=10, max_total_tokens=13) == 2  # 2 drafts + 1 own = 13
    assert draft_limit(4, num_tokens=10, max_total_tokens=11) == 0


# --- acceptance -------------------------------------------------------------------------------


def test_greedy_acceptance_keeps_the_agreeing_prefix_then_the_models_token() -> None:
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all + bonus
    assert accept_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]  # first mismatch corrected
    assert accept_greedy([1, 5, 6, 7], [4, 5, 6]) == [1]
    assert accept_greedy([3], []) == [3]


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    keep = expected > 0
    assert float(counts[~keep].sum()) == 0  # nothing drawn where the target has no mass
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# With a fixed seed these tests are deterministic; the bounds hold with a wide margin for a
# correct sampler (expected TV ~0.01, chi-square ~ its degrees of freedom) and fail by far
# for a biased one (always or never accepting the draft moves TV by p(d) or 1 - p(d)).
SAMPLES = 20000


@pytest.mark.parametrize("draft_token", [0, 2, 5])
def test_speculative_sampling_preserves_the_target_distribution(draft_token: int) -> None:
    probs = torch.tensor([0.30, 0.05, 0.20, 0.0, 0.15, 0.30])  # tiny vocabulary, one zero
    generator = torch.Generator().manual_seed(123)
    counts = torch.zeros(6)
    accepted = 0
    for _ in range(SAMPLES):
        tokens = accept_sampled(torch.stack([probs, probs]), [draft_token], generator)
        counts[tokens[0]] += 1
        accepted += len(tokens) == 2
    assert _tv(counts, probs) < 0.02
    assert _chi2(counts, probs) < 30  # 4 degrees of freedom: p ~ 1e-5
    # the draft is kept about p(d) of the time
    assert abs(accepted / SAMPLES - float(probs[draft_token])) < 0.02


def test_speculative_sampling_preserves_the_joint_distribution_over_two_positions() -> None:
    """A toy model over 4 tokens: p1(x), then p2(y | x). Speculation drafts (d1, d2); when the
    step ends after one token, the second comes from an ordinary decode step. The joint
    (x, y) must be p1(x) p2(y | x)."""
    p1 = torch.tensor([0.1, 0.4, 0.2, 0.3])
    p2 = torch.tensor(
        [[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25], [0.0, 0.5, 0.5, 0.0], [0.1, 0.2, 0.3, 0.4]]
    )
    draft = [1, 3]
    rows = torch.stack([p1, p2[draft[0]], torch.full((4,), 0.25)])
    generator = torch.Generator().manual_seed(7)
    counts = torch.zeros(4, 4)
    for _ in range(SAMPLES):
        tokens = accept_sampled(rows, draft, generator)
        if len(tokens) == 1:
            noise = torch.empty(4).exponential_(generator=generator)
            tokens.append(int((p2[tokens[0]] / noise).argmax()))
        counts[tokens[0], tokens[1]] += 1
    joint = p1[:, None] * p2
    assert _tv(counts.flatten(), joint.flatten()) < 0.025
    assert _chi2(counts.flatten(), joint.flatten()) < 60  # 13 degrees of freedom: p ~ 1e-7


def test_a_biased_sampler_fails_the_same_bound() -> None:
    """The bound above is not vacuous: always accepting the draft is caught."""
    probs = torch.tensor([0.30, 0.05, 0.20, 0.0, 0.15, 0.30])
    counts = torch.zeros(6)
    generator = torch.Generator().manual_seed(123)
    for _ in range(SAMPLES):
        u = float(torch.rand((), generator=generator))
        counts[2 if u < 0.5 else int(torch.multinomial(probs, 1, generator=generator))] += 1
    assert _tv(counts, probs) > 0.2


# --- the sampler along a draft ------------------------------------------------------------------


@dataclass
class Row:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    output_token_ids: list[int] = field(default_factory=list)
    matcher: Any = None
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))


def _sequential_greedy(logits: torch.Tensor, row: Row, draft: list[int]) -> list[int]:
    """What decoding one token per step would pick at each draft position."""
    picks = []
    for i in range(len(draft) + 1):
        at = Row(row.params, row.prompt_token_ids, row.output_token_ids + draft[:i])
        picks.append(sample(logits[i : i + 1].clone(), [at]).token_ids[0])
    return picks


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=1.8),
        SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=1.5),
        SamplingParams(temperature=0, logit_bias={4: 5.0, 7: -100}),
    ],
    ids=["plain", "repetition", "frequency+presence", "logit_bias"],
)
def test_verify_processes_each_position_as_decoding_would(params: SamplingParams) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 12) * 2
    logits[:, 4] += 1.0  # token 4 leads everywhere: penalties on it matter
    row = Row(params, output_token_ids=[4, 9])
    good: list[int] = []  # what decoding picks, position by position
    for i in range(3):
        good.append(_sequential_greedy(logits, row, good)[i])
    # a draft made of what decoding picks is accepted whole, plus the bonus token
    expected_all = _sequential_greedy(logits, row, good)
    assert verify_drafts(logits.clone(), [row], [good])[0].token_ids == expected_all
    # a draft that disagrees at position 1 keeps position 0 and corrects position 1
    bad = [good[0], (good[1] + 1) % 12, good[2]]
    corrected = _sequential_greedy(logits, row, bad)[:2]
    assert verify_drafts(logits.clone(), [row], [bad])[0].token_ids == corrected


def test_verify_reports_the_logprob_of_every_yielded_token() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 10)
    row = Row(SamplingParams(temperature=0, logprobs=2))
    draft = [int(logits[0].argmax()), int(logits[1].argmax())]
    result = verify_drafts(logits.clone(), [row], [draft])[0]
    assert result.token_ids == draft + [int(logits[2].argmax())]
    expected = logits.log_softmax(-1).max(-1).values.tolist()
    assert result.logprobs == pytest.approx(expected)
    assert [len(t) for t in result.top_logprobs] == [2, 2, 2]


def test_verify_keeps_rows_of_several_sequences_apart() -> None:
    torch.manual_seed(2)
    logits = torch.randn(2 + 1 + 3, 10)
    a = Row(SamplingParams(temperature=0))
    b = Row(SamplingParams(temperature=0))
    a_draft = [int(logits[0].argmax())]
    b_draft = [int(logits[2].argmax()), (int(logits[3].argmax()) + 1) % 10]
    results = verify_drafts(logits.clone(), [a, b], [a_draft, b_draft])
    assert results[0].token_ids == a_draft + [int(logits[1].argmax())]
    assert results[1].token_ids == [b_draft[0], int(logits[3].argmax())]


# --- grammar masks along a draft ------------------------------------------------------------------


def test_draft_grammar_masks_follow_the_draft_and_roll_back(smollm_tokenizer) -> None:
    from preheat.engine.request.sampling_params import StructuredOutput
    from preheat.engine.sample.structured import GrammarBackend, apply_draft_grammar_masks, apply_grammar_masks

    tok = smollm_tokenizer
    vocab = len(tok)
    backend = GrammarBackend(tok, vocab)
    matcher = backend.new_matcher(backend.compile(StructuredOutput("regex", "(ab|cd)+!")))
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    allowed_before = torch.zeros(1, vocab)
    apply_grammar_masks(allowed_before, [matcher])

    logits = torch.zeros(3, vocab)
    apply_draft_grammar_masks(logits, [(0, matcher, [a, b])])
    # row 0: at the start; row 1: after "a" only "b" may follow; row 2: after "ab"
    assert torch.equal(logits[0], allowed_before[0])
    assert bool(torch.isfinite(logits[1, b])) and not bool(torch.isfinite(logits[1, a]))
    assert bool(torch.isfinite(logits[2, a])) and not bool(torch.isfinite(logits[2, b]))

    again = torch.zeros(1, vocab)
    apply_grammar_masks(again, [matcher])
    assert torch.equal(again, allowed_before)  # rolled back: the matcher is where it was

    # a draft token the grammar refuses stops the walk there (its own row masks it out)
    logits = torch.zeros(3, vocab)
    apply_draft_grammar_masks(logits, [(0, matcher, [b, a])])
    assert not bool(torch.isfinite(logits[0, b]))
    assert torch.isfinite(logits[1]).all()  # never read: the draft is rejected at row 0
    assert matcher.accept_token(a)  # still at the start


# --- planning pages for drafts ------------------------------------------------------------------


def _decoding(sid: str, num_tokens: int, num_pages: int, num_draft: int) -> SeqView:
    return SeqView(sid, num_tokens, num_tokens - 1, num_pages, num_pages, num_draft=num_draft)


def test_planner_reserves_pages_for_draft_tokens() -> None:
    # 8 tokens in 2 pages of 4: the token itself fits, 3 drafts need a third page
    running = [_decoding("a", 8, 2, 3), _decoding("b", 5, 2, 0)]
    plan = plan_step(running, [], free_pages=5, page_size=4, max_num_seqs=8, chunk_budget=64)
    assert plan.decode == ["a", "b"]
    assert plan.drafts == {"a": 3}
    assert plan.pages == {"a": 1, "b": 0}


def test_planner_drops_drafts_rather_than_preempting_for_them() -> None:
    running = [_decoding("a", 8, 2, 4), _decoding("b", 8, 2, 4)]
    plan = plan_step(running, [], free_pages=1, page_size=4, max_num_seqs=8, chunk_budget=64)
    assert plan.decode == ["a", "b"] and not plan.preempt
    assert plan.drafts == {}
    assert plan.pages == {"a": 0, "b": 0}


@pytest.mark.parametrize("free_pages", range(0, 6))
def test_planner_never_grants_more_pages_than_free(free_pages: int) -> None:
    for drafts in itertools.product([0, 2, 7], repeat=3):
        running = [_decoding(f"s{i}", 4 * (i + 1), i + 1, d) for i, d in enumerate(drafts)]
        plan = plan_step(running, [], free_pages, page_size=4, max_num_seqs=8, chunk_budget=64)
        freed = sum(v.reclaimable_pages for v in running if v.seq_id in plan.preempt)
        assert sum(plan.pages.values()) <= free_pages + freed
        for sid, n in plan.drafts.items():
            view = next(v for v in running if v.seq_id == sid)
            assert n == view.num_draft
            assert view.num_pages + plan.pages[sid] >= -(-(view.num_computed + 1 + n) // 4)


# --- settings -----------------------------------------------------------------------------------


def test_vllm_style_speculative_config_maps_to_our_settings() -> None:
    from preheat.engine.config import ConfigError, EngineConfig, parse_args
    from preheat.engine.llm import speculative_settings

    assert speculative_settings({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}) == {
        "speculative_method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
    }
    with pytest.raises(ValueError, match="draft_model"):
        speculative_settings({"method": "ngram", "draft_model": "x"})
    cfg = parse_args(["--speculative-method", "ngram", "--num-speculative-tokens", "6",
                      "--prompt-lookup-max", "3", "--prompt-lookup-min", "1"])
    assert (cfg.speculative_method, cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (
        "ngram", 6, 3, 1,
    )
    assert parse_args([]).speculative_method is None
    assert parse_args([]).speculative_gate == "auto"
    assert parse_args(["--speculative-gate", "always"]).speculative_gate == "always"
    with pytest.raises(ConfigError, match="--speculative-gate"):
        EngineConfig(speculative_method="ngram", speculative_gate="sometimes")
    with pytest.raises(ConfigError, match="--speculative-method"):
        EngineConfig(speculative_method="eagle")
    with pytest.raises(ConfigError, match="--prompt-lookup-min"):
        EngineConfig(speculative_method="ngram", prompt_lookup_min=5, prompt_lookup_max=2)
