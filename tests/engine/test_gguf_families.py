"""Qwen3 and Qwen3-MoE from GGUF files (the architectures transformers reads from GGUF besides
the Llama family): the first start converts through transformers, the next reads the weight
cache, and both generate what transformers generates from the same file."""

from __future__ import annotations

import pytest
import torch
from test_parity import reference_greedy
from tiny_models import write_tiny_gguf

from preheat.engine import LLM, SamplingParams


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_a_gguf_generates_what_transformers_generates_converted_and_from_cache(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, arch)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    assert reference.config.model_type == arch
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 259, (n,), generator=g).tolist() for n in (4, 30, 61)]
    expected = reference_greedy(reference, prompts, 16)
    params = SamplingParams(max_tokens=16, temperature=0)
    cache = str(tmp_path / "weights")

    for from_cache in (False, True):
        llm = LLM(model=str(path), dtype="float32", page_size=4, max_total_tokens=1024, weight_cache_dir=cache,
                  chunked_prefill_size=24)  # fmt: skip
        assert llm.engine.weights_from_cache is from_cache
        assert llm.engine.model_config.architecture == arch
        assert [r.token_ids for r in llm.generate(prompts, params)] == expected
