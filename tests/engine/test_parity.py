"""Greedy output is token-for-token what transformers' generate produces on the same
weights in float32 — through prefix-cache hits, chunked prefill and preemption — for every
family we serve (tiny random-weight models: tests/tiny_models.py)."""

from __future__ import annotations

import pytest
import torch

from preheat.engine import LLM, SamplingParams


def reference_greedy(model_dir_or_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = model_dir_or_model
    if not hasattr(hf, "generate"):
        hf = AutoModelForCausalLM.from_pretrained(model_dir_or_model, dtype=torch.float32)
    out = []
    for prompt in prompts:
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
        out.append(ids[0, len(prompt) :].tolist())
    return out


def mixed_prompts(seed: int, shared_len: int = 37) -> list[list[int]]:
    """Different lengths, several sharing a prefix that spans page boundaries."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 49000, (shared_len,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 49000, (n,), generator=g).tolist() for n in (1, 5, 60, 13)]
    prompts.append(torch.randint(3, 49000, (90,), generator=g).tolist())
    prompts.append(torch.randint(3, 49000, (2,), generator=g).tolist())
    return prompts


@pytest.mark.parametrize(
    "arch_fixture",
    ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_mistral_dir", "tiny_qwen3_dir", "tiny_qwen3_moe_dir",
     "tiny_mixtral_dir"],
)
def test_greedy_matches_transformers_with_cache_hits_and_chunked_prefill(arch_fixture, request):
    model_dir = request.getfixturevalue(arch_fixture)
    prompts = mixed_prompts(0)
    expected = reference_greedy(model_dir, prompts, 24)
    llm = LLM(model=str(model_dir), dtype="float32", page_size=4, max_total_tokens=4096, chunked_prefill_size=40)
    params = SamplingParams(max_tokens=24, temperature=0)

    first = llm.generate(prompts, params)
    second = llm.generate(prompts, params)  # now mostly served from the radix cache

    assert [r.token_ids for r in first] == expected
    assert [r.token_ids for r in second] == expected
    assert all(r.cached_tokens > 0 for r in second if len(r.prompt_token_ids) > 8)
    assert llm.engine.stats().cached_tokens_total > 0


@pytest.mark.parametrize("arch_fixture", ["tiny_llama_dir", "tiny_qwen3_moe_dir"])
def test_greedy_matches_transformers_under_preemption(arch_fixture, request):
    model_dir = request.getfixturevalue(arch_fixture)
    prompts = mixed_prompts(1)
    expected = reference_greedy(model_dir, prompts, 40)
    # 48 pages of 4 tokens cannot hold all six sequences to the end: some are preempted
    # and recomputed.
    llm = LLM(model=str(model_dir), dtype="float32", page_size=4, max_total_tokens=192, chunked_prefill_size=64)
    results = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0))
    assert [r.token_ids for r in results] == expected
    assert llm.engine.stats().preemptions_total > 0
    assert llm.engine.pool.num_used_pages == llm.engine.radix.total_pages  # nothing leaked


def test_greedy_matches_transformers_without_radix_cache(tiny_qwen2_dir):
    prompts = mixed_prompts(2)
    expected = reference_greedy(tiny_qwen2_dir, prompts, 16)
    llm = LLM(model=str(tiny_qwen2_dir), dtype="float32", page_size=16, disable_radix_cache=True, chunked_prefill_size=32)
    results = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert [r.token_ids for r in results] == expected
    assert all(r.cached_tokens == 0 for r in results)
    assert llm.engine.pool.num_used_pages == 0


@pytest.mark.slow
def test_embedded_smollm2_matches_transformers():
    # quantization="none": the GGUF's weights dequantized, as transformers reads them (by
    # default the engine serves its Q4_1 blocks as they are: tests/engine/test_int8.py)
    llm = LLM(dtype="float32", max_total_tokens=1024, page_size=16, chunked_prefill_size=48, quantization="none")
    tok = llm.tokenizer
    system = "You are a concise assistant for a bicycle shop. Answer in one sentence. " * 3
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=False,
            ),
            add_special_tokens=False,
        )
        for q in ("What is a derailleur?", "How often should I oil the chain?", "Hi")
    ]
    prompts.append(tok.encode("The three primary colours are"))
    # The weight cache holds the GGUF's weights as a Hugging Face directory: the same
    # weights, without transformers' slow GGUF parsing a second time.
    assert llm.engine.hf_dir is not None
    expected = reference_greedy(llm.engine.hf_dir, prompts, 20)
    params = SamplingParams(max_tokens=20, temperature=0)
    first = llm.generate(prompts, params)
    second = llm.generate(prompts[:3], params)
    assert [r.token_ids for r in first] == expected
    assert [r.token_ids for r in second] == expected[:3]
    assert all(r.cached_tokens >= 48 for r in second)  # the shared system prompt, at least


def test_a_sliding_window_shorter_than_the_context_caps_the_context():
    from transformers import MistralConfig

    from preheat.engine.model.spec import ModelSpec

    windowed = MistralConfig(max_position_embeddings=32768, sliding_window=4096)
    unwindowed = MistralConfig(max_position_embeddings=32768, sliding_window=None)
    assert ModelSpec.from_hf_config(windowed).max_position_embeddings == 4096
    assert ModelSpec.from_hf_config(unwindowed).max_position_embeddings == 32768


def test_llama_with_attention_and_mlp_biases_matches_transformers(tmp_path, smollm_tokenizer):
    """`attention_bias` puts a bias on q/k/v and o_proj, `mlp_bias` on gate/up/down."""
    from tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "biased", "llama", smollm_tokenizer, attention_bias=True,
                                 mlp_bias=True)  # fmt: skip
    prompts = mixed_prompts(3)[:3]
    expected = reference_greedy(model_dir, prompts, 12)
    llm = LLM(model=str(model_dir), dtype="float32", page_size=4, max_total_tokens=1024)
    assert [r.token_ids for r in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))] == expected
