"""Tiny random-weight models of each family we serve, built from a transformers config and
saved as Hugging Face directories (no download). Shared by the engine and kernel tests."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_config(arch: str, tokenizer, **overrides):
    """A transformers config of the given family, tiny. Qwen3's head_dim (24) is not
    hidden / heads (16), as in the real Qwen3 models; the MoE configs have more experts than
    the top-k and (Qwen3-MoE) a dense layer among the sparse ones."""
    import transformers

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.25,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=1,
    )
    family = {
        "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
        "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
        "mistral": (transformers.MistralConfig, dict(tie_word_embeddings=False)),
        "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=True, head_dim=24)),
        "qwen3_moe": (
            transformers.Qwen3MoeConfig,
            dict(tie_word_embeddings=False, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1], head_dim=24),
        ),
        "mixtral": (transformers.MixtralConfig, dict(tie_word_embeddings=False, num_local_experts=4,
                                                     num_experts_per_tok=2)),
    }
    config_class, family_overrides = family[arch]
    return config_class(**{**common, **family_overrides, **overrides})


def build_tiny_model(path: Path, arch: str, tokenizer, max_shard_size: str | None = None, **overrides) -> Path:
    """Saves a random-weight model of the given family as a Hugging Face directory (sharded
    when `max_shard_size` is given). A large initializer range makes logits peaked, so
    greedy decoding has clear winners."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, tokenizer, **overrides), dtype=torch.float32)
    if max_shard_size is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(path)
    return path
