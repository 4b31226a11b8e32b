"""A Qwen3-MoE model served with the experts on the Triton kernel (PREHEAT_MOE_BACKEND=triton;
on CPU under the interpreter) generates what transformers generates: the kernel wired into
the forward pass, not only next to it."""

from __future__ import annotations

import importlib.util

import torch
from _kernels import triton_moe
from tiny_models import build_tiny_model

from preheat.engine import LLM, SamplingParams
from preheat.engine.model.loader import DEFAULT_GGUF_NAME, DEFAULT_GGUF_PACKAGE


def test_qwen3_moe_with_triton_experts_matches_transformers(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE).submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=DEFAULT_GGUF_NAME)
    model_dir = build_tiny_model(tmp_path / "moe", "qwen3_moe", tokenizer)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (5, 23, 40)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist() for p in prompts]

    calls = []
    real = triton_moe.fused_experts
    monkeypatch.setattr(triton_moe, "fused_experts", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("PREHEAT_MOE_BACKEND", "triton")
    llm = LLM(model=str(model_dir), dtype="float32", page_size=4, max_total_tokens=512, chunked_prefill_size=32)
    results = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    assert [r.token_ids for r in results] == expected
    assert calls  # the experts really ran on the kernel
