"""Prompt-only requests and prompt logprobs (what SGLang's max_new_tokens=0 and
logprob_start_len mean) through the real engine, checked against transformers' own forward
pass of the same tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from preheat.engine import LLM, SamplingParams


def _run(engine, prompt: list[int], params: SamplingParams):
    rid = engine.add_request(prompt, params)
    final = None
    while final is None:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    return final


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path):
    """Prompt-token logprobs from transformers: row p predicts token p + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return logprobs


def test_prompt_logprobs_match_a_full_forward_pass_even_over_a_cached_prefix(tiny_llama_dir: Path, reference) -> None:
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=512,
              chunked_prefill_size=16)
    engine = llm.engine
    prompt = list(range(1000, 1040))  # 40 tokens: computed in three chunks of 16
    _run(engine, prompt, SamplingParams(max_tokens=1, ignore_eos=True))  # now cached
    start = 9
    out = _run(engine, prompt, SamplingParams(prompt_only=True, prompt_logprobs=3, prompt_logprobs_start=start))
    assert out.finish_reason == "length" and out.token_ids == [] and out.text == ""
    assert out.cached_tokens <= start  # the cache served no position whose logprob was asked
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) - start and entries[0] is None
    ref = reference(prompt)
    for i, entry in enumerate(entries[1:], start=start + 1):
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
        top_v, top_i = ref[i - 1].topk(3)
        assert [t for t, _ in entry.top] == top_i.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_v.tolist(), abs=1e-4)


def test_a_prompt_only_request_caches_its_prompt_for_the_next(tiny_llama_dir: Path) -> None:
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", page_size=4, max_total_tokens=512)
    engine = llm.engine
    prefix = list(range(2000, 2024))
    first = _run(engine, prefix, SamplingParams(prompt_only=True))
    assert first.finish_reason == "length" and first.token_ids == [] and first.cached_tokens == 0
    second = _run(engine, prefix + [7, 8, 9], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
    assert second.cached_tokens == 24 and len(second.token_ids) == 2
