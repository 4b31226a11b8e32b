"""Rotary position embedding, the model's side: which scalings we serve exactly, and the
inverse frequencies of a config (the cos/sin numerics are engine/kernels/rope.py's, which
this module re-exports: the kernels rotate with them and must not import the model).

The inverse frequencies of every scaled variant come from transformers' own
`ROPE_INIT_FUNCTIONS`, so a Llama 3.x (`llama3`), a Qwen long-context (`yarn`) or a
`linear` config gets the frequencies transformers computes, not a re-derivation of them.
"""

from __future__ import annotations

from typing import Any

import torch

from preheat.engine.kernels.rope import RotaryEmbedding, apply_rope
from preheat.engine.model.families import UnsupportedModelError

__all__ = ["RotaryEmbedding", "apply_rope", "check_rope_type", "rope_inv_freq", "rope_parameters"]

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
