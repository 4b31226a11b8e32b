"""The engine on an AVX2-only CPU, forced here (PREHEAT_CPU_KERNELS=avx2): the backend it
builds runs the extension's AVX2 kernels, and greedy generation gives the tokens of the
PyTorch reference, in float32 (attention, RMSNorm, SiLU, RoPE in the kernels) and with int8
weights (the int8 GEMM on vpmaddwd)."""

from __future__ import annotations

import pytest

from preheat.engine import LLM, SamplingParams
from preheat.engine.kernels import cpu_ext

PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 160))]


@pytest.fixture
def forced_avx2(monkeypatch):
    if "avx2" not in cpu_ext.runnable_isas(cpu_ext.read_cpu_flags()):
        pytest.skip("this CPU runs no AVX2 code")
    monkeypatch.setattr(cpu_ext, "_loaded", {})
    monkeypatch.setenv(cpu_ext.ENV_ISA, "avx2")
    monkeypatch.delenv("PREHEAT_ATTENTION_BACKEND", raising=False)
    return monkeypatch


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_avx2_kernels_generate_the_reference_tokens(tiny_llama_dir, forced_avx2, quantization):
    params = SamplingParams(max_tokens=12, temperature=0)
    kw = dict(model=str(tiny_llama_dir), dtype="float32", max_total_tokens=2048, page_size=4,
              quantization=quantization)  # fmt: skip
    llm = LLM(**kw)
    backend = llm.engine.model.layers[0].attn.backend
    assert backend.name == "cpu" and backend.kernels.isa == "avx2"
    if quantization == "int8":
        assert llm.engine.model.layers[0].attn.qkv.kind == "int8"
    ours = [r.token_ids for r in llm.generate(PROMPTS, params)]
    del llm
    forced_avx2.setenv("PREHEAT_ATTENTION_BACKEND", "torch")
    reference = LLM(**kw)
    assert [r.token_ids for r in reference.generate(PROMPTS, params)] == ours
