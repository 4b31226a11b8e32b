"""Prompt chunks on the CPU extend kernel (engine/kernels/cpu/extend_attention_avx512.cpp for
bfloat16 on the AVX-512 build, extend_attention_avx2.cpp for the AVX2 build and float32): a
model with head_dim 64 prefills through it — first chunks, chunks over a cached prefix,
several prompts in one step — and scores its prompts as the PyTorch backend's SDPA path
does, within bfloat16's rounding (float32: within float32's)."""

from __future__ import annotations

import pytest
from tiny_models import build_tiny_model

from preheat.engine import LLM, SamplingParams
from preheat.engine.kernels import cpu_attention, cpu_ext

kernels = cpu_ext.load()
pytestmark = pytest.mark.skipif(kernels is None, reason=cpu_ext.unavailable_reason or "no CPU kernels here")


@pytest.fixture(scope="module")
def head_dim_64(tmp_path_factory, smollm_tokenizer):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-hd64"), "llama", smollm_tokenizer,
                            hidden_size=256, num_attention_heads=4, num_key_value_heads=2)


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt token's logprob (after the first), the prompts added together."""
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(prompt_only=True, prompt_logprobs=0)) for p in prompts]
    finals = {}
    while len(finals) < len(ids):
        finals |= {out.request_id: out for out in engine.step() if out.finished}
    return [[e.logprob for e in finals[i].prompt_logprobs[1:]] for i in ids]


def mean_gap(x: list[list[float]], y: list[list[float]]) -> float:
    gaps = [abs(a - b) for u, v in zip(x, y, strict=True) for a, b in zip(u, v, strict=True)]
    return sum(gaps) / len(gaps)


def test_prompts_prefill_on_the_extend_kernel_and_score_like_sdpa(head_dim_64, monkeypatch):
    """The tiny random model's prompt logprobs lie around -8 to -33, where bfloat16 alone moves
    them by ~0.1 against float32; the kernel must stay as close to float32 as SDPA does (a
    masking or softmax slip moves them by whole units)."""
    calls: list[int] = []
    real = cpu_attention.long_extend
    monkeypatch.setattr(cpu_attention, "long_extend", lambda *a, **k: calls.append(1) or real(*a, **k))
    shared = list(range(500, 600))
    prompts = [shared + list(range(700, 760)), list(range(1000, 1090)), shared + list(range(800, 830))]
    kw = dict(model=str(head_dim_64), max_total_tokens=4096, page_size=16, chunked_prefill_size=64)
    ours = LLM(dtype="bfloat16", **kw)
    first = prompt_logprobs(ours, prompts[:2])  # two prompts, chunks of 64 over their own prefixes
    cached = prompt_logprobs(ours, prompts[2:])  # the third extends the first one's cached 100 tokens
    assert calls, "no prompt chunk ran on the extend kernel"
    calls.clear()
    float32 = LLM(dtype="float32", **kw)
    f32_first = prompt_logprobs(float32, prompts[:2])
    f32_cached = prompt_logprobs(float32, prompts[2:])
    assert calls, "no float32 prompt chunk ran on the extend kernel"
    calls.clear()
    monkeypatch.setattr(cpu_attention, "long_extend_eligible", lambda *a: False)
    sdpa = LLM(dtype="bfloat16", **kw)
    with_sdpa = prompt_logprobs(sdpa, prompts[:2]) + prompt_logprobs(sdpa, prompts[2:])
    sdpa32 = LLM(dtype="float32", **kw)
    float32_sdpa = prompt_logprobs(sdpa32, prompts[:2]) + prompt_logprobs(sdpa32, prompts[2:])
    assert not calls
    assert mean_gap(f32_first + f32_cached, float32_sdpa) < 1e-3  # float32 on the kernel: SDPA's answer
    assert mean_gap(first + cached, float32_sdpa) <= 1.15 * mean_gap(with_sdpa, float32_sdpa) + 0.01
    assert mean_gap(first + cached, with_sdpa) < 0.1
