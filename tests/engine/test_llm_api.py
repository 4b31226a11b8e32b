"""The offline Python API, shaped like vLLM's: `LLM(...).generate(prompts, params)`, and the
engine calls it rests on (add_request validation, abort_request)."""

from __future__ import annotations

from pathlib import Path

import pytest

from preheat.engine import LLM, SamplingParams
from preheat.engine.request.errors import RequestRejected

MAX_MODEL_LEN = 96
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=1024, max_model_len=MAX_MODEL_LEN)


def test_the_public_names_import_from_preheat_engine() -> None:
    import preheat.engine as engine

    assert engine.LLM is LLM and engine.SamplingParams is SamplingParams


def test_the_tokenizer_is_exposed(llm: LLM) -> None:
    ids = llm.tokenizer.encode("hello world")
    assert ids and llm.tokenizer.decode(ids) == "hello world"


def test_a_single_string_or_a_single_token_list_is_one_prompt(llm: LLM) -> None:
    by_text = llm.generate("hello world", GREEDY)
    ids = llm.tokenizer.encode("hello world")
    by_ids = llm.generate(ids, GREEDY)
    assert len(by_text) == len(by_ids) == 1
    assert by_text[0].prompt_token_ids == by_ids[0].prompt_token_ids == ids
    assert by_text[0].token_ids == by_ids[0].token_ids


def test_results_come_back_one_per_prompt_in_order_with_generated_tokens_only(llm: LLM) -> None:
    prompts: list[str | list[int]] = ["a b c d e f g", [5, 6, 7], "x", "the quick brown fox jumps over"]
    alone = [llm.generate(p, GREEDY)[0] for p in prompts]
    together = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    for prompt, r in zip(prompts, together):
        expected_prompt = prompt if isinstance(prompt, list) else llm.tokenizer.encode(prompt)
        assert r.prompt_token_ids == expected_prompt
        assert len(r.token_ids) == 8  # generated only: the prompt is not repeated in them
        assert r.finish_reason == "length"
        assert r.text == llm.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        assert r.outputs == [r]  # vLLM's `result.outputs[0].text` habit works


def test_an_empty_list_is_no_prompts_and_gives_no_results(llm: LLM) -> None:
    assert llm.generate([], GREEDY) == []


def test_one_params_per_prompt_applies_to_its_own_prompt(llm: LLM) -> None:
    results = llm.generate(["one", "two"], [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)])
    assert [len(r.token_ids) for r in results] == [2, 5]


def test_a_params_list_of_the_wrong_length_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["one", "two"], [GREEDY])
    assert not llm.engine.has_unfinished()


def test_cached_tokens_report_the_prompt_served_from_the_prefix_cache(llm: LLM) -> None:
    prompt = list(range(1000, 1030))  # 30 tokens: 7 whole pages of 4
    first = llm.generate(prompt, GREEDY)[0]
    second = llm.generate(prompt, GREEDY)[0]
    assert first.cached_tokens == 0
    # Whole pages only, and never the last prompt token (its logits must be computed).
    assert second.cached_tokens == 28
    assert second.token_ids == first.token_ids


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", GREEDY, "empty"),
        ([[]], GREEDY, "empty"),  # one prompt of no tokens ([] alone is a list of no prompts)
        ([1] * MAX_MODEL_LEN, GREEDY, "context length"),
        ([1] * 90, SamplingParams(max_tokens=10), "context length"),
        ([1, 2, 49152], GREEDY, r"token ids must be in \[0, 49152\)"),
        ([1, -1], GREEDY, r"token ids must be in"),
    ],
    ids=["empty string", "empty ids", "prompt too long", "prompt+max_tokens too long", "id >= vocab", "negative id"],
)
def test_a_bad_request_raises_a_clear_value_error(llm: LLM, prompt: str | list[int], params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, params)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), r"max_tokens must be in \[1, "),
        (dict(temperature=-0.1), r"temperature must be in \[0, 100\]"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=10**22), "top_k"),  # the repro: an overflow inside torch before
        (dict(repetition_penalty=1e-300), r"repetition_penalty must be in \[0.01, 100\]"),
        (dict(seed=2**64), "seed"),
        (dict(logprobs=21), "logprobs"),
        (dict(stop=["x"] * 17), "stop"),
        (dict(stop="y" * 257), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
    ],
)
def test_bad_sampling_params_raise_a_clear_value_error(kwargs: dict, message: str) -> None:
    with pytest.raises(RequestRejected, match=message) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)  # the Python API's callers catch ValueError
    assert info.value.code == "invalid_value" and info.value.param == next(iter(kwargs))


def test_a_temperature_below_the_floor_is_greedy(llm: LLM) -> None:
    """temperature 1e-45 divided logits into inf before (garbage tokens); now it is greedy."""
    prompt = list(range(1000, 1012))
    greedy = llm.generate(prompt, GREEDY)[0]
    tiny = llm.generate(prompt, SamplingParams(max_tokens=GREEDY.max_tokens, temperature=1e-45, seed=3))[0]
    assert tiny.token_ids == greedy.token_ids
    assert SamplingParams(temperature=1e-45).greedy and not SamplingParams(temperature=1e-4).greedy


def test_params_mutated_into_a_bad_state_are_refused_at_submission(llm: LLM) -> None:
    params = SamplingParams()
    params.temperature = -1.0  # dataclasses are mutable: validate again when the request arrives
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("hi", params)


def test_abort_frees_the_requests_pages_at_the_next_step(llm: LLM) -> None:
    engine = llm.engine
    assert engine.radix is not None
    rid = engine.add_request(list(range(2000, 2023)), SamplingParams(max_tokens=40, ignore_eos=True))
    queued = engine.add_request(list(range(3000, 3010)), SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.pool.num_used_pages > engine.radix.total_pages  # private pages of running requests
    engine.abort_request(rid)
    engine.abort_request(queued)
    outs = {o.request_id: o for o in engine.step()}
    assert outs[rid].finished and outs[rid].finish_reason == "abort"
    assert outs[queued].finished and outs[queued].finish_reason == "abort"
    assert not engine.has_unfinished()
    # Every page in use now belongs to the prefix cache, and none is locked any more.
    assert engine.pool.num_used_pages == engine.radix.total_pages
    assert engine.radix.protected_pages == 0
