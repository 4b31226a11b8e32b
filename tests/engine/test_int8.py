"""`--quantization int8`: the format, GGUF blocks read as they are, and the engine serving with
it (kernel and PyTorch reference agreeing; snapshots told apart)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from preheat.engine import LLM, SamplingParams
from preheat.engine.config import ConfigError, parse_args
from preheat.engine.kernels import cpu_ext, int8
from preheat.engine.model import gguf_weights


def test_symmetric_quantization_is_within_half_a_step_per_weight():
    w = torch.randn(48, 160) * torch.logspace(-3, 1, 160)  # very different block ranges
    qw = int8.quantize(w)
    assert qw.codes.dtype == torch.uint8 and qw.scales.shape == (48, 5)
    err = (int8.dequantize(qw) - w).abs().reshape(48, 5, 32)
    step = qw.scales.float()[..., None]
    assert bool((err <= step / 2 + 1e-6 * w.abs().max()).all())
    assert int8.quantize(torch.zeros(16, 32)).scales.abs().sum() == 0  # an all-zero block stays zero


def test_a_matrix_whose_input_size_is_not_a_multiple_of_32_is_refused():
    with pytest.raises(ValueError, match="divisible by 32"):
        int8.quantize(torch.zeros(4, 48))


@pytest.mark.parametrize("kind,parse", [("Q4_1", gguf_weights.q4_1_blocks), ("Q8_0", gguf_weights.q8_0_blocks)])
def test_gguf_blocks_are_read_exactly(kind, parse):
    import gguf

    x = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind])
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    assert torch.equal(int8.dequantize(parse(raw)), torch.from_numpy(expected))


def test_q_and_k_rows_are_unpermuted_as_transformers_does():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = torch.randn(24, 64)
    expected = LlamaTensorProcessor()._reverse_permute_weights(w.numpy(), 6, 2)
    qw = gguf_weights.unpermute_rows(int8.quantize(w), 2)
    assert torch.equal(int8.dequantize(qw), int8.dequantize(int8.quantize(torch.from_numpy(expected))))


def test_gguf_names_map_to_transformers_names():
    assert gguf_weights.hf_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert gguf_weights.hf_name("blk.0.ffn_gate.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert gguf_weights.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_weights.hf_name("blk.0.attn_norm.weight") is None


@pytest.mark.slow
def test_the_embedded_gguf_int8_weights_are_the_weights_everything_else_reads():
    """Q4_1 layers and the Q8_0 embedding, unpermuted, equal transformers' dequantized
    weights: exactly, once both are rounded to the bfloat16 the engine serves."""
    from preheat.engine.model.loader import default_model_path, load_model

    loaded = load_model(None, torch.bfloat16, None)
    weights = gguf_weights.read_int8_weights(default_model_path(), loaded.spec.num_heads, loaded.spec.num_kv_heads)
    assert len(weights) == 7 * loaded.spec.num_layers + 1  # every layer matrix and the tied embedding
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(int8.dequantize(weights[name], torch.bfloat16), loaded.weights[name]), name


def test_the_flag_is_parsed_and_checked():
    assert parse_args(["--quantization", "int8"]).quantization == "int8"
    assert parse_args([]).quantization is None
    with pytest.raises(ConfigError, match="--quantization: 'int4' is not one of int8"):
        parse_args(["--quantization", "int4"])


def test_int8_serving_matches_its_reference_and_changes_the_snapshot_fingerprint(tiny_llama_dir, monkeypatch):
    """The int8 kernel path (linear layers on vpdpbusd) and the PyTorch reference of the same
    arithmetic generate the same greedy tokens; the KV of int8 weights is not interchangeable
    with the unquantized model's, so snapshots record the difference."""
    prompts = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 160))]
    params = SamplingParams(max_tokens=12, temperature=0)
    kw = dict(model=str(tiny_llama_dir), dtype="float32", max_total_tokens=2048, page_size=4)
    llm = LLM(quantization="int8", **kw)
    assert llm.engine.model.layers[0].attn.qkv.kind == ("int8" if cpu_ext.load() is not None else "int8-reference")
    ours = [r.token_ids for r in llm.generate(prompts, params)]
    fingerprint = llm.engine.fingerprint
    monkeypatch.setenv("PREHEAT_ATTENTION_BACKEND", "torch")
    reference = LLM(quantization="int8", **kw)
    assert reference.engine.model.layers[0].attn.qkv.kind == "int8-reference"
    assert [r.token_ids for r in reference.generate(prompts, params)] == ours
    plain = LLM(**kw)
    assert fingerprint["quantization"] == "int8" and "quantization" not in plain.engine.fingerprint
