"""The shape of a Llama-family model, read once from its transformers config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {"llama", "qwen2", "mistral"}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @staticmethod
    def from_hf_config(config: Any) -> ModelSpec:
        arch = config.model_type
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model type {arch!r}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        qkv_bias = arch == "qwen2" or bool(getattr(config, "attention_bias", False))
        return ModelSpec(
            architecture=arch,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=_context_limit(config),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
        )

    def kv_bytes_per_token(self, kv_dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=kv_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def _context_limit(config: Any) -> int:
    """The longest sequence we serve exactly. Our attention is full attention: a Mistral-style
    sliding window shorter than the context would change the output beyond the window, so the
    context is capped at the window instead."""
    limit = int(getattr(config, "max_position_embeddings", 4096))
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", True)  # Qwen2 keeps a window it does not use
    if window and uses_window and int(window) < limit:
        return int(window)
    return limit


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings under either transformers 5 (`rope_parameters`) or 4 (`rope_theta`
    + `rope_scaling`) naming."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    scaling.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return scaling


def rope_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """inverse frequencies and attention scaling, honouring the config's RoPE scaling."""
    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = float(params.get("rope_theta", 10000.0))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic RoPE scaling changes with sequence length and is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported RoPE type {rope_type!r}")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv, float(scaling)
