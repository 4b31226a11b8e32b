"""Sampling: the batched sampler on hand-made logits, then the request-level behaviour
(seeds, stop strings, stop ids, max_tokens, ignore_eos) through the engine on a tiny model."""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from preheat.engine import LLM, SamplingParams
from preheat.engine.sample.sampler import apply_logit_bias, apply_penalties, apply_top_k_top_p_min_p, sample


@dataclass
class Row:
    """The fields the sampler reads from a sequence."""

    params: SamplingParams
    seed: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    matcher: Any = None
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)


def random_logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# --- choosing a token ------------------------------------------------------------------------------


def test_greedy_is_argmax_for_every_row_even_beside_sampled_rows() -> None:
    logits = random_logits(4)
    rows = [Row(SamplingParams(temperature=0)), Row(SamplingParams(temperature=1.5), seed=3)] * 2
    result = sample(logits.clone(), rows)
    argmax = logits.argmax(-1).tolist()
    assert result.token_ids[0] == argmax[0] and result.token_ids[2] == argmax[2]
    assert result.logprobs is None and result.top_logprobs is None  # nobody asked


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=5.0, top_p=1e-6),
        SamplingParams(temperature=5.0, min_p=1.0),
    ],
    ids=["top_k=1", "tiny top_p", "min_p=1"],
)
def test_filters_that_leave_one_token_equal_greedy(params: SamplingParams) -> None:
    logits = random_logits(64, seed=1)
    rows = [Row(params, seed=i) for i in range(64)]
    assert sample(logits.clone(), rows).token_ids == logits.argmax(-1).tolist()


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 2.0, 3.0]] * 2)
    masked = apply_top_k_top_p_min_p(logits, torch.tensor([3, -1]), torch.ones(2), torch.zeros(2))
    kept = masked > torch.finfo(masked.dtype).min
    assert kept[0].tolist() == [False, True, False, True, False, True]
    assert kept[1].all()  # -1: off for that row, whatever the other row asks


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    masked = apply_top_k_top_p_min_p(probs.log(), torch.tensor([-1]), torch.tensor([0.7]), torch.zeros(1))
    kept = (masked > torch.finfo(masked.dtype).min)[0].tolist()
    assert kept == [True, True, False, False]  # 0.5 < 0.7 <= 0.5 + 0.3


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    masked = apply_top_k_top_p_min_p(probs.log(), torch.tensor([-1]), torch.ones(1), torch.tensor([0.4]))
    kept = (masked > torch.finfo(masked.dtype).min)[0].tolist()
    assert kept == [True, True, False, False]  # threshold 0.4 x 0.5 = 0.2


def test_sampling_follows_the_temperature_scaled_distribution() -> None:
    # 4000 independent rows from one distribution; each frequency within 0.03 of
    # softmax(logits / T) (about 6 standard deviations at these sizes).
    n, temperature = 4000, 0.7
    base = torch.tensor([2.0, 1.5, 0.5, -1.0])
    expected = (base / temperature).softmax(-1)
    rows = [Row(SamplingParams(temperature=temperature), seed=i) for i in range(n)]
    tokens = torch.tensor(sample(base.repeat(n, 1), rows).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


def test_a_seeded_row_draws_the_same_token_whatever_else_is_in_the_batch() -> None:
    logits = random_logits(1, seed=7)[0]
    params = SamplingParams(temperature=1.0)
    alone = [sample(logits[None].clone(), [Row(params, seed=s)]).token_ids[0] for s in range(20)]
    others = random_logits(3, seed=8)
    mixed = []
    for s in range(20):
        batch = torch.stack([others[0], others[1], logits, others[2]])
        rows = [Row(params, seed=99), Row(SamplingParams(temperature=0)), Row(params, seed=s), Row(params, seed=5)]
        mixed.append(sample(batch, rows).token_ids[2])
    assert alone == mixed
    assert len(set(alone)) > 1  # the seeds really do sample (a flat test would prove nothing)


# --- penalties ---------------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0], [2.0, -2.0, 2.0, -2.0, 1.0]])
    rows = [
        Row(SamplingParams(repetition_penalty=2.0), prompt_token_ids=[0, 1], output_token_ids=[1]),
        Row(SamplingParams()),  # penalties off: untouched even when its batch-mate has them
    ]
    apply_penalties(logits, rows)
    assert logits[0].tolist() == [1.0, -4.0, 2.0, -2.0, 1.0]  # tokens 0 (prompt) and 1 seen
    assert logits[1].tolist() == [2.0, -2.0, 2.0, -2.0, 1.0]


def test_frequency_and_presence_penalties_count_generated_tokens_only() -> None:
    logits = torch.zeros(1, 5)
    row = Row(
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        prompt_token_ids=[4, 4, 4],  # the prompt does not count for these two
        output_token_ids=[1, 1, 1, 2],
    )
    apply_penalties(logits, [row])
    # token 1: 3 x 0.5 + 0.25; token 2: 1 x 0.5 + 0.25
    assert logits[0].tolist() == [0.0, -1.75, -0.75, 0.0, 0.0]


def test_negative_frequency_and_presence_penalties_encourage_repeats() -> None:
    logits = torch.zeros(1, 3)
    apply_penalties(logits, [Row(SamplingParams(frequency_penalty=-1.0, presence_penalty=-0.5), output_token_ids=[2, 2])])
    assert logits[0].tolist() == [0.0, 0.0, 2.5]


def test_sample_applies_penalties_before_choosing() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    row = Row(SamplingParams(temperature=0, presence_penalty=1.0), output_token_ids=[0])
    assert sample(logits, [row]).token_ids == [1]


# --- logprobs -----------------------------------------------------------------------------------------


def test_logprobs_of_the_chosen_token_and_the_top_k_match_log_softmax() -> None:
    logits = random_logits(3, seed=11)
    reference = logits.log_softmax(-1)
    rows = [
        Row(SamplingParams(temperature=0, logprobs=3)),
        Row(SamplingParams(temperature=1.0, logprobs=0), seed=4),  # chosen only
        Row(SamplingParams(temperature=0)),  # asked for none
    ]
    result = sample(logits.clone(), rows)
    assert result.logprobs is not None and result.top_logprobs is not None
    for i, token in enumerate(result.token_ids):
        assert math.isclose(result.logprobs[i], reference[i, token].item(), rel_tol=1e-5, abs_tol=1e-6)
    values, indices = reference[0].topk(3)
    assert [t for t, _ in result.top_logprobs[0]] == indices.tolist()
    assert [lp for _, lp in result.top_logprobs[0]] == pytest.approx(values.tolist(), abs=1e-6)
    assert result.top_logprobs[1] == [] and result.top_logprobs[2] == []


def test_logit_bias_adds_to_its_own_rows_tokens_only() -> None:
    logits = random_logits(3)
    rows = [Row(SamplingParams(logit_bias={7: 2.5, 9: -1.0})), Row(SamplingParams()), Row(SamplingParams(logit_bias={7: -4}))]
    biased = logits.clone()
    apply_logit_bias(biased, rows)
    expected = logits.clone()
    expected[0, 7] += 2.5
    expected[0, 9] -= 1.0
    expected[2, 7] -= 4
    assert torch.equal(biased, expected)


def test_a_bias_of_100_forces_a_token_and_minus_100_bans_one() -> None:
    logits = random_logits(2)
    top = logits.argmax(-1).tolist()
    rows = [Row(SamplingParams(temperature=0, logit_bias={3: 100})),
            Row(SamplingParams(temperature=1.0, logit_bias={top[1]: -100}), seed=5)]
    for _ in range(20):
        chosen = sample(logits.clone(), rows).token_ids
        assert chosen[0] == 3 and chosen[1] != top[1]


@pytest.mark.parametrize(
    "bias, message",
    [({5: 101}, "in [-100, 100]"), ({-1: 1}, "-1 is not a token id"), ({"x": 1}, "token ids to numbers")],
)
def test_bad_logit_bias_is_refused(bias, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(logit_bias=bias)


# --- through the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=2048)


PROMPTS = ["The weather today is", "Once upon a time", "1, 2, 3,", "Paris is the capital of"]


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_any_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.8, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded)[0].token_ids
    again = llm.generate(PROMPTS[0], seeded)[0].token_ids  # now a prefix-cache hit, too
    batch_params = [
        SamplingParams(temperature=1.0, seed=7, max_tokens=5),
        seeded,
        SamplingParams(temperature=0, max_tokens=20),
        SamplingParams(temperature=0.5, max_tokens=9),  # unseeded
    ]
    mixed = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3]], batch_params)[1].token_ids
    assert alone == again == mixed
    other_seed = llm.generate(PROMPTS[0], SamplingParams(temperature=0.8, seed=4321, max_tokens=12, ignore_eos=True))
    assert other_seed[0].token_ids != alone  # the seed matters (else the test proves nothing)


def test_logit_bias_steers_generation_and_out_of_vocabulary_ids_are_refused(llm: LLM) -> None:
    forced = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={11: 100}))
    assert forced[0].token_ids == [11] * 6
    with pytest.raises(ValueError, match="not in the vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, logit_bias={10**7: 1}))


def test_max_tokens_ends_with_length(llm: LLM) -> None:
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert len(out.token_ids) == 7
    assert out.finish_reason == "length"


def test_a_stop_string_cuts_the_text_and_finishes_with_stop(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    full = llm.generate(PROMPTS[3], greedy)[0]
    assert len(full.text) > 12
    stop = full.text[6:9]  # three characters from the middle of the free-running text
    cut = full.text.index(stop)
    out = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)
    kept = llm.generate(
        PROMPTS[3],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop, include_stop_str_in_output=True),
    )[0]
    assert kept.text == full.text[: cut + len(stop)]


def test_a_stop_token_id_ends_generation_with_stop(llm: LLM) -> None:
    full = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    target = full.token_ids[5]
    first = full.token_ids.index(target)
    out = llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[target])
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: first + 1]  # the stop token is the last one returned
    # Its text is not part of the output.
    assert out.text == llm.tokenizer.decode(full.token_ids[:first], skip_special_tokens=True)


def test_eos_stops_generation_unless_ignore_eos(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # The same weights with the model's EOS set to a token that greedy decoding emits.
    plain = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=512)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = plain.generate(PROMPTS[0], greedy)[0].token_ids
    eos = tokens[4]
    first = tokens.index(eos)
    eos_dir = tmp_path / "eos"
    shutil.copytree(tiny_llama_dir, eos_dir)
    config = json.loads((eos_dir / "config.json").read_text())
    config["eos_token_id"] = eos
    (eos_dir / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(eos_dir), dtype="float32", page_size=4, max_total_tokens=512)

    stopped = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == tokens[: first + 1]

    ignored = llm.generate(PROMPTS[0], greedy)[0]
    assert ignored.finish_reason == "length"
    assert ignored.token_ids == tokens


def test_streamed_text_pieces_join_to_the_final_text_and_never_show_the_stop_string(llm: LLM) -> None:
    full = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    stop = full.text[8:11]
    engine = llm.engine
    rid = engine.add_request(PROMPTS[3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))
    pieces: list[str] = []
    final = None
    while final is None:
        for out in engine.step():
            if out.request_id == rid:
                pieces.append(out.new_text)
                assert stop not in "".join(pieces)  # held back while it could still become the stop
                if out.finished:
                    final = out
    assert "".join(pieces) == final.text == full.text[: full.text.index(stop)]
