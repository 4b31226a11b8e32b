"""The shape of a model, read once from its transformers config.

Every family we run is a pre-norm decoder (Llama layout): attention with RoPE and grouped
KV heads, then a SiLU-gated MLP — dense, or a sparse mixture of experts in some layers.
`ModelSpec` holds what differs between families as plain numbers and flags, so the forward
pass (engine/model/decoder.py) never looks at `model_type`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from preheat.engine.model.families import FAMILIES, UnsupportedModelError, family_for
from preheat.engine.model.rope import check_rope_type, rope_parameters

# Re-exported for callers that ask what is supported.
SUPPORTED_ARCHITECTURES = frozenset(FAMILIES)


@dataclass(frozen=True)
class MoESpec:
    """A sparse mixture-of-experts MLP: each token goes to `top_k` of `num_experts` SiLU-gated
    experts of width `intermediate_size`, weighted by the router's softmax."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # rescale the top-k probabilities to sum to 1 (Mixtral always; Qwen3 `norm_topk_prob`)
    sparse_layers: tuple[int, ...]  # layer indices with experts; the others have a dense MLP


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # of the dense MLP (layers without experts)
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    moe: MoESpec | None = None

    @staticmethod
    def from_hf_config(config: Any) -> ModelSpec:
        arch = config.model_type
        family = family_for(arch)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{arch}: unsupported MLP activation {act!r}; the engine runs SiLU-gated MLPs")
        check_rope_type(rope_parameters(config).get("rope_type", "default"))
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
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
            qkv_bias=family.qkv_bias or attention_bias,
            # transformers gives o_proj a bias exactly where it gives q/k/v one through
            # `attention_bias` (Llama, Qwen3); Qwen2's fixed q/k/v bias has none on o_proj.
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=family.qk_norm,
            moe=_moe_spec(family.moe, config),
        )

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers

    def kv_bytes_per_token(self, kv_dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=kv_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def _moe_spec(kind: str | None, config: Any) -> MoESpec | None:
    """Which layers carry experts and how the router normalises, as transformers builds them:
    Mixtral — every layer, softmax over the top-k logits (= softmax, top-k, renormalise);
    Qwen3-MoE — layer i unless listed in `mlp_only_layers`, when (i + 1) is a multiple of
    `decoder_sparse_step`; renormalised only with `norm_topk_prob`."""
    if kind is None:
        return None
    layers = range(config.num_hidden_layers)
    if kind == "mixtral":
        return MoESpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=True,
            sparse_layers=tuple(layers),
        )
    if kind == "qwen3_moe":
        num_experts = int(getattr(config, "num_experts", 0) or 0)
        dense_only = set(getattr(config, "mlp_only_layers", None) or [])
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        sparse = tuple(i for i in layers if i not in dense_only and num_experts > 0 and (i + 1) % step == 0)
        if not sparse:
            return None  # no layer has experts: a dense Qwen3 in MoE clothing
        return MoESpec(
            num_experts=num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            sparse_layers=sparse,
        )
    raise ValueError(f"unknown MoE kind {kind!r}")


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
