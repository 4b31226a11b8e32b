"""Rotary position embedding, the numerics: cos/sin per position and the rotation itself.

It lives with the kernels because both sides need it: the model builds a `RotaryEmbedding`
from its config (engine/model/rope.py works out the frequencies), and the kernel backends
rotate q and k with `apply_rope` (the reference) or read `RotaryEmbedding.table` (the CPU
kernel). Keeping it here lets both reach it with kernels importing nothing of the model.
"""

from __future__ import annotations

import torch


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
