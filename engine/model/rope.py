"""Rotary position embedding: which scalings we serve exactly, and cos/sin per position.

The inverse frequencies of every scaled variant come from transformers' own
`ROPE_INIT_FUNCTIONS`, so a Llama 3.x (`llama3`), a Qwen long-context (`yarn`) or a
`linear` config gets the frequencies transformers computes, not a re-derivation of them.
"""

from __future__ import annotations

from typing import Any

import torch

from preheat.engine.model.families import UnsupportedModelError

# Scalings whose frequencies do not depend on the sequence: one table serves every position.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# "dynamic" (NTK) recomputes the frequencies only once a sequence grows past
# max_position_embeddings; below that, transformers uses exactly its init-time frequencies,
# and we never serve past it (the context limit is max_position_embeddings at most).
WITHIN_CONTEXT_STATIC = ("dynamic",)


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


def check_rope_type(rope_type: str) -> None:
    """Refuses, at load, a scaling we cannot serve exactly (e.g. `longrope`, whose
    frequencies switch with the sequence's length)."""
    if rope_type not in STATIC_ROPE_TYPES + WITHIN_CONTEXT_STATIC:
        raise UnsupportedModelError(
            f"unsupported RoPE scaling {rope_type!r}; supported: {', '.join(STATIC_ROPE_TYPES + WITHIN_CONTEXT_STATIC)}"
        )


def rope_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, honouring the config's RoPE scaling."""
    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    check_rope_type(rope_type)
    if rope_type == "default":
        base = float(params.get("rope_theta", 10000.0))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv, float(scaling)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin`, where rotate_half(x) = [-x2, x1].
    Rolling x by half gives [x2, x1]; the sign lives in `signed_sin` = [-sin, sin] instead
    (negation is exact, so the result is bit-identical with two kernels fewer per layer)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class RotaryEmbedding:
    """cos and signed sin (see apply_rope) per position, computed the way transformers
    computes cos/sin (float32, then cast)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype) -> None:
        self.inv_freq = inv_freq.to(torch.float32)
        self.scaling = attention_scaling
        self.dtype = dtype

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.scaling).to(self.dtype)
        sin = (freqs.sin() * self.scaling).to(self.dtype)
        signed_sin = torch.cat((-sin, sin), dim=-1)
        return cos[:, None, :], signed_sin[:, None, :]  # broadcast over heads

    def table(self, positions_needed: int) -> torch.Tensor:
        """cos | signed sin rows [n, 2 * head_dim] for positions 0..n-1: the values __call__
        computes, kept (grown by doubling) for the CPU kernel to look up."""
        table = getattr(self, "_table", None)
        if table is None or table.shape[0] < positions_needed:
            n = max(1024, 1 << max(0, positions_needed - 1).bit_length())
            cos, sin = self(torch.arange(n, device=self.inv_freq.device))
            table = self._table = torch.cat((cos[:, 0], sin[:, 0]), dim=-1).contiguous()
        return table
