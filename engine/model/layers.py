"""The parts of a decoder layer: RMSNorm, attention over the paged KV pool, the dense MLP.

Each part holds its own weights and the head / width counts they imply, and takes everything
per-step as arguments (no module-level state): a tensor-parallel rank holds the same classes
with its slice of heads or width. The numerics follow transformers (RMSNorm in float32 then
cast, RoPE in float32 then cast) so greedy output matches it token for token in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from preheat.engine.kernels import attention
from preheat.engine.model.rope import apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in float32, cast back, then scale. torch's fused
    rms_norm gives bit-identical results with half the kernel launches. `weight` broadcasts
    over the last dimensions of x (a [heads, head_dim] weight scales each head by its own)."""
    return weight * F.rms_norm(x.to(torch.float32), x.shape[-1:], eps=eps).to(x.dtype)


@dataclass
class AttentionMetadata:
    """Where each row of a flat batch reads and writes KV."""

    positions: torch.Tensor  # int64 [T]
    slots: torch.Tensor  # int64 [T]
    num_decode: int  # rows [0, num_decode) are decode tokens, one per sequence
    decode_page_table: torch.Tensor | None  # int32 [num_decode, max_pages]
    decode_seq_lens: torch.Tensor | None  # int32 [num_decode], including the new token
    extend_page_table: torch.Tensor | None  # int32 [num_extend_seqs, max_pages]
    extend_prefix_lens: list[int]
    extend_lens: list[int]


@dataclass
class StepContext:
    """Per-forward-pass inputs every layer shares: the batch layout, the bookkeeping the
    attention backend prepared once for all layers, and the rotary cos/sin of each row."""

    meta: AttentionMetadata
    rows: int  # real rows; the matmuls may run on more (padding), attention never does
    padded_rows: int
    cos: torch.Tensor
    sin: torch.Tensor
    prepared_decode: Any
    prepared_extend: Any


class Attention:
    """Grouped-query attention with RoPE: fused q/k/v projection, optional per-head q/k
    RMSNorm (Qwen3), the paged KV write and attention, the output projection."""

    def __init__(
        self,
        qkv: torch.Tensor,  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
        o: torch.Tensor,  # [hidden, num_heads * head_dim]
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: torch.Tensor | None = None,
        o_bias: torch.Tensor | None = None,
        q_norm: torch.Tensor | None = None,  # [head_dim]
        k_norm: torch.Tensor | None = None,  # [head_dim]
        norm_eps: float = 1e-6,
    ) -> None:
        if qkv.shape[0] != (num_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError(f"qkv has {qkv.shape[0]} rows, expected ({num_heads} + 2*{num_kv_heads}) * {head_dim}")
        self.qkv, self.qkv_bias, self.o, self.o_bias = qkv, qkv_bias, o, o_bias
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.norm_eps = norm_eps
        # q and k heads sit side by side in qkv; one [heads_q + heads_k, head_dim] weight
        # normalises all of them in one pass (each head by its own q or k weight).
        self.qk_norm = (
            torch.cat((q_norm.expand(num_heads, head_dim), k_norm.expand(num_kv_heads, head_dim)))
            if q_norm is not None and k_norm is not None
            else None
        )

    def weights(self) -> list[torch.Tensor]:
        return [t for t in (self.qkv, self.qkv_bias, self.o, self.o_bias, self.qk_norm) if t is not None]

    def forward(
        self, x: torch.Tensor, ctx: StepContext, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """x: [padded_rows, hidden] (normed) -> [padded_rows, hidden], before the residual."""
        heads_q, heads_kv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = heads_q * hd, heads_kv * hd
        rows, meta = ctx.rows, ctx.meta
        qkv = F.linear(x, self.qkv, self.qkv_bias)
        qk = qkv[:, : q_size + kv_size].view(-1, heads_q + heads_kv, hd)
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, self.norm_eps)
        # q and k rotated in one pass (half the ops per layer).
        qk = apply_rope(qk, ctx.cos, ctx.sin)
        q, k = qk[:rows].split([heads_q, heads_kv], dim=1)
        v = qkv[:rows, q_size + kv_size :].view(-1, heads_kv, hd)
        attention.write_kv(k_cache, v_cache, k, v, meta.slots)
        nd = meta.num_decode
        if nd == rows:
            o = attention.decode_attention(
                q, k_cache, v_cache, meta.decode_page_table, meta.decode_seq_lens, self.scale, ctx.prepared_decode
            )
        elif nd == 0:
            o = attention.extend_attention(
                q, k_cache, v_cache, meta.extend_page_table,
                meta.extend_prefix_lens, meta.extend_lens, self.scale, ctx.prepared_extend,
            )  # fmt: skip
        else:
            o = torch.cat(
                (
                    attention.decode_attention(
                        q[:nd], k_cache, v_cache, meta.decode_page_table,
                        meta.decode_seq_lens, self.scale, ctx.prepared_decode,
                    ),  # fmt: skip
                    attention.extend_attention(
                        q[nd:], k_cache, v_cache, meta.extend_page_table,
                        meta.extend_prefix_lens, meta.extend_lens, self.scale, ctx.prepared_extend,
                    ),  # fmt: skip
                )
            )
        o = o.reshape(rows, q_size)
        if ctx.padded_rows > rows:
            o = F.pad(o, (0, 0, 0, ctx.padded_rows - rows))
        return F.linear(o, self.o, self.o_bias)


class DenseMLP:
    """SiLU-gated MLP, gate and up fused into one matmul: down(silu(gate(x)) * up(x))."""

    def __init__(
        self,
        gate_up: torch.Tensor,  # [2 * intermediate, hidden], gate rows first
        down: torch.Tensor,  # [hidden, intermediate]
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> None:
        self.gate_up, self.down, self.gate_up_bias, self.down_bias = gate_up, down, gate_up_bias, down_bias
        self.intermediate_size = down.shape[1]

    def weights(self) -> list[torch.Tensor]:
        return [t for t in (self.gate_up, self.down, self.gate_up_bias, self.down_bias) if t is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up, self.gate_up_bias).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down, self.down_bias)
