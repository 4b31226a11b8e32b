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
    greedy decoding has clear winners; biases (Qwen2's q/k/v, Llama's optional ones) are
    random too."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, tokenizer, **overrides), dtype=torch.float32)
    with torch.no_grad():  # transformers starts biases at zero, where a misplaced one would not show
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.25)
    if max_shard_size is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(path)
    return path


def write_tiny_gguf(path: Path, arch: str):
    """Writes a tiny random-weight Qwen3 or Qwen3-MoE as a GGUF file the way llama.cpp lays one
    out (its tensor names, experts stacked per layer, a byte-level BPE vocabulary of 260
    tokens in the metadata) and returns the transformers model it was made from.

    transformers reads no head_dim for qwen3 and no expert width for qwen3moe from GGUF
    metadata (it keeps its config defaults, 128 and 768, which the real models use), so
    this model uses those values."""
    import gguf
    import transformers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "Ġt", "he", "Ġthe", "<|endoftext|>"]
    vocab, eos = len(tokens), len(tokens) - 1
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=512,
                  initializer_range=0.25, eos_token_id=eos, bos_token_id=eos, tie_word_embeddings=False,
                  rms_norm_eps=1e-6)  # fmt: skip
    torch.manual_seed(4321)
    if arch == "qwen3":
        config, gguf_arch, name_arch = transformers.Qwen3Config(**common), "qwen3", gguf.MODEL_ARCH.QWEN3
    elif arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=768, norm_topk_prob=True)  # fmt: skip
        gguf_arch, name_arch = "qwen3moe", gguf.MODEL_ARCH.QWEN3MOE
    else:
        raise ValueError(arch)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_name(f"tiny {arch}")
    w.add_context_length(512)
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(128)
    w.add_value_length(128)
    w.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    if arch == "qwen3_moe":
        w.add_expert_count(4)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(768)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * eos + [3])
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_eos_token_id(eos)
    w.add_bos_token_id(eos)
    names = gguf.get_tensor_name_map(name_arch, config.num_hidden_layers)
    for name, t in model.state_dict().items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("mlp.experts.gate_up_proj"):  # llama.cpp keeps gate and up apart
            gate, up = t.chunk(2, dim=1)
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", gate.contiguous().numpy())
            w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", up.contiguous().numpy())
        elif name.endswith("mlp.experts.down_proj"):
            w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", t.contiguous().numpy())
        else:
            w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model
