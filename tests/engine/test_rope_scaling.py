"""RoPE scalings: the cos/sin we compute are the ones transformers computes for every scaling
we accept, the ones we cannot serve exactly are refused, and a Llama 3.x model (llama3
scaling) generates what transformers generates."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_parity import reference_greedy
from tiny_models import build_tiny_model

from preheat.engine import LLM, SamplingParams
from preheat.engine.model.families import UnsupportedModelError
from preheat.engine.model.rope import RotaryEmbedding, check_rope_type, rope_inv_freq
from preheat.engine.model.spec import ModelSpec

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # fmt: skip


@pytest.mark.parametrize(
    "config",
    [
        transformers.LlamaConfig(head_dim=32, max_position_embeddings=512, rope_scaling=LLAMA3),
        transformers.LlamaConfig(head_dim=32, rope_scaling={"rope_type": "linear", "factor": 4.0}),
        transformers.LlamaConfig(head_dim=32, max_position_embeddings=512,
                                 rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
        transformers.Qwen3Config(head_dim=32, max_position_embeddings=1024,
                                 rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 256}),
        transformers.Qwen2Config(hidden_size=128, num_attention_heads=4),  # default
    ],
    ids=["llama3", "linear", "dynamic", "yarn", "default"],
)
def test_cos_sin_are_transformers_cos_sin(config):
    """Up to the longest context we serve (dynamic NTK only rescales past it)."""
    spec = ModelSpec.from_hf_config(config)
    theirs = {
        "LlamaConfig": transformers.models.llama.modeling_llama.LlamaRotaryEmbedding,
        "Qwen3Config": transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding,
        "Qwen2Config": transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding,
    }[type(config).__name__](config)
    positions = torch.arange(spec.max_position_embeddings)
    want_cos, want_sin = theirs(torch.zeros(1, dtype=torch.float32), positions[None])
    inv_freq, scaling = rope_inv_freq(config, spec.head_dim)
    cos, signed_sin = RotaryEmbedding(inv_freq, scaling, torch.float32)(positions)
    half = spec.head_dim // 2
    assert torch.equal(cos[:, 0], want_cos[0])
    assert torch.equal(signed_sin[:, 0, half:], want_sin[0, :, half:])
    assert torch.equal(signed_sin[:, 0, :half], -want_sin[0, :, :half])


def test_scalings_that_change_with_the_sequence_are_refused():
    with pytest.raises(UnsupportedModelError, match="unsupported RoPE scaling 'longrope'; supported: default, linear"):
        check_rope_type("longrope")


def test_llama3_scaling_changes_the_frequencies_it_should():
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling=LLAMA3)
    scaled, _ = rope_inv_freq(config, 16)
    plain, _ = rope_inv_freq(transformers.LlamaConfig(hidden_size=64, num_attention_heads=4), 16)
    assert torch.equal(scaled[:1], plain[:1])  # short wavelengths kept
    assert torch.allclose(scaled[-3:], plain[-3:] / 8)  # long ones slowed by the factor


def test_a_llama3_scaled_model_generates_what_transformers_generates(tmp_path, smollm_tokenizer):
    model_dir = build_tiny_model(tmp_path / "llama3", "llama", smollm_tokenizer, rope_scaling=LLAMA3)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 49000, (70,), generator=g).tolist()
    # Up to ~200 tokens: far past the 32-token "original" context, where the scaled
    # frequencies have turned by visibly different angles.
    prompts = [shared + torch.randint(3, 49000, (n,), generator=g).tolist() for n in (3, 110)]
    prompts.append(torch.randint(3, 49000, (150,), generator=g).tolist())
    expected = reference_greedy(model_dir, prompts, 20)

    # The test can tell: without the scaling, transformers itself generates otherwise.
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    plain.model.rotary_emb = type(plain.model.rotary_emb)(
        transformers.LlamaConfig(**{**plain.config.to_dict(), "rope_scaling": None, "rope_parameters": None})
    )
    assert reference_greedy(plain, prompts, 20) != expected

    llm = LLM(model=str(model_dir), dtype="float32", page_size=4, max_total_tokens=2048, chunked_prefill_size=48)
    params = SamplingParams(max_tokens=20, temperature=0)
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected
    second = llm.generate(prompts, params)  # prefixes from the radix cache
    assert [r.token_ids for r in second] == expected
    assert all(r.cached_tokens > 0 for r in second)
