"""The SGLang /generate request in Preheat's terms (engine/sglang/params.py, pure) and
SGLang's flag names (engine/config.py): no server, no model."""

from __future__ import annotations

import pytest

from preheat.engine.config import parse_args
from preheat.engine.request.api_errors import APIError
from preheat.engine.sglang.params import plan_generate, sampling_params
from preheat.engine.sglang.protocol import GenerateRequest


def plan(**body):
    return plan_generate(GenerateRequest.model_validate(body))


def test_a_batch_with_n_expands_prompt_major_and_names_each_output():
    p = plan(text=["a", "b"], rid=["x", "y"], sampling_params={"n": 2})
    assert not p.single and p.n == 2
    assert [(q.prompt, q.rid) for q in p.prompts] == [("a", "x-0"), ("a", "x-1"), ("b", "y-0"), ("b", "y-1")]
    one = plan(text="a", rid="z")
    assert one.single and [q.rid for q in one.prompts] == ["z"]
    assert not plan(text="a", sampling_params={"n": 3}).single  # SGLang answers n samples as a list
    assert plan(input_ids=[1, 2]).single and not plan(input_ids=[[1, 2], [3]]).single


def test_per_prompt_fields_must_match_the_batch():
    with pytest.raises(APIError) as e:
        plan(text=["a", "b"], sampling_params=[{"n": 1}])
    assert e.value.param == "sampling_params"
    with pytest.raises(APIError) as e:
        plan(text=["a", "b"], sampling_params=[{"n": 1}, {"n": 2}])
    assert e.value.param == "sampling_params.n"


def test_sglang_sampling_names_become_preheat_params():
    sp = GenerateRequest.model_validate({"text": "a", "sampling_params": {
        "max_new_tokens": 7, "temperature": 0, "top_k": -1, "top_p": 0.5, "min_p": 0.1, "sampling_seed": 10,
        "stop": "x", "stop_token_ids": [3], "ignore_eos": True, "no_stop_trim": True,
        "repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": -0.5,
        "logit_bias": {"5": -100}, "regex": "[ab]+"}}).sampling_params
    params = sampling_params(sp, None, sample=2)
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p, params.min_p) == (7, 0, -1, 0.5, 0.1)
    assert params.seed == 12  # the third sample of seed 10
    assert params.stop == ["x"] and params.stop_token_ids == [3] and params.ignore_eos
    assert params.include_stop_str_in_output  # no_stop_trim
    assert (params.repetition_penalty, params.frequency_penalty, params.presence_penalty) == (1.2, 0.5, -0.5)
    assert params.logit_bias == {5: -100.0}
    assert params.structured.kind == "regex" and params.structured.spec == "[ab]+"
    assert params.logprobs is None and params.prompt_logprobs is None and not params.prompt_only


def test_defaults_logprobs_and_prompt_only():
    default = GenerateRequest.model_validate({"text": "a"})
    p = plan_generate(default).prompts[0]
    params = sampling_params(p.params, p.logprobs, 0)
    assert params.max_tokens == 128 and params.temperature == 1.0  # SGLang's defaults
    p = plan(text="a", sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=3,
             top_logprobs_num=4).prompts[0]
    params = sampling_params(p.params, p.logprobs, 0)
    assert params.prompt_only and params.logprobs == 4
    assert params.prompt_logprobs == 4 and params.prompt_logprobs_start == 3
    out_only = plan(text="a", return_logprob=True).prompts[0]  # logprob_start_len -1: output only
    assert sampling_params(out_only.params, out_only.logprobs, 0).prompt_logprobs is None
    json_schema = plan(text="a", sampling_params={"json_schema": '{"type": "object"}'}).prompts[0]
    assert sampling_params(json_schema.params, None, 0).structured.spec == {"type": "object"}


@pytest.mark.parametrize("body, param", [
    ({"text": "a", "image_data": "x.png"}, "image_data"),
    ({"text": "a", "return_hidden_states": True}, "return_hidden_states"),
    ({"text": "a", "sampling_params": [{"structural_tag": "{}"}]}, "sampling_params.0.structural_tag"),
    ({"text": "a", "sampling_params": {"beam_width": 4}}, "sampling_params.beam_width"),
    ({"text": "a", "sampling_params": {"skip_special_tokens": False}}, "sampling_params.skip_special_tokens"),
    ({"text": "a", "log_metrics": False}, "log_metrics"),
])
def test_what_cannot_be_honoured_is_named(body, param):
    with pytest.raises(APIError) as e:
        plan(**body)
    assert e.value.status == 400 and e.value.param == param and param.split(".")[-1] in e.value.message


def test_what_asks_for_nothing_passes():
    plan(text="a", log_metrics=True, image_data=None, return_hidden_states=False, sampling_params={
        "min_new_tokens": 0, "stop_regex": [], "skip_special_tokens": True, "beam_width": 1, "ebnf": None})


def test_sglang_flag_names_are_aliases():
    cfg = parse_args(["--model-path", "m.gguf", "--context-length", "1024", "--max-running-requests", "3",
                      "--tp-size", "2", "--hicache-storage-prefetch-policy", "timeout"])
    assert (cfg.model, cfg.max_model_len, cfg.max_num_seqs, cfg.tensor_parallel_size, cfg.prefetch_policy) == (
        "m.gguf", 1024, 3, 2, "timeout")
