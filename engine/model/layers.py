"""The parts of a decoder layer: RMSNorm, attention over the paged KV pool, the dense MLP.

Each part holds its own weights, the head / width counts they imply and the kernel backend
it was built for (engine/kernels/backend.py: the weights' form depends on it), and takes
everything per-step as arguments (no module-level state): a tensor-parallel rank holds the
same classes with its slice of heads or width. The numerics follow transformers (RMSNorm in float32 then
cast, RoPE in float32 then cast) so greedy output matches it token for token in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from preheat.engine.kernels.backend import KernelBackend
from preheat.engine.kernels.fused import RopeInputs, rms_norm
from preheat.engine.kernels.int8 import QuantizedWeight
from preheat.engine.kernels.linear import LinearWeight
from preheat.engine.kernels.torch_backend import TorchBackend

__all__ = ["Attention", "AttentionMetadata", "DenseMLP", "StepContext", "rms_norm"]


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
    # Every extend is a draft's verification (each of its rows is sampled): the CPU decode
    # stack may then run the step as decode rows (engine/model/decode_stack.py).
    verify_only: bool = False


@dataclass
class StepContext:
    """Per-forward-pass inputs every layer shares: the batch layout, the bookkeeping the
    attention backend prepared once for all layers, and the rotary cos/sin of each row."""

    meta: AttentionMetadata
    rows: int  # real rows; the matmuls may run on more (padding), attention never does
    padded_rows: int
    rope: RopeInputs  # the rows' rotary inputs (cos/sin, or the CPU kernel's table)
    prepared_decode: Any
    prepared_extend: Any


class Attention:
    """Grouped-query attention with RoPE: fused q/k/v projection, optional per-head q/k
    RMSNorm (Qwen3), the paged KV write and attention, the output projection. The
    projections may be int8 (engine/kernels/int8.py); `backend.prepare_linear` keeps them in
    the form the backend multiplies by (default backend: the PyTorch reference)."""

    def __init__(
        self,
        qkv: torch.Tensor | QuantizedWeight | LinearWeight,  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
        o: torch.Tensor | QuantizedWeight | LinearWeight,  # [hidden, num_heads * head_dim]
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: torch.Tensor | None = None,
        o_bias: torch.Tensor | None = None,
        q_norm: torch.Tensor | None = None,  # [head_dim]
        k_norm: torch.Tensor | None = None,  # [head_dim]
        norm_eps: float = 1e-6,
        dtype: torch.dtype | None = None,  # the activations' (default: the weights')
        backend: KernelBackend | None = None,
    ) -> None:
        if qkv.shape[0] != (num_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError(f"qkv has {qkv.shape[0]} rows, expected ({num_heads} + 2*{num_kv_heads}) * {head_dim}")
        dtype = dtype or (qkv.dtype if isinstance(qkv, torch.Tensor) else torch.bfloat16)
        self.backend = kernels = backend or TorchBackend()
        self.qkv = kernels.prepare_linear(qkv, qkv_bias, dtype)
        self.o = kernels.prepare_linear(o, o_bias, dtype)
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
        return [*self.qkv.tensors(), *self.o.tensors(), *([self.qk_norm] if self.qk_norm is not None else [])]

    def forward(
        self, x: torch.Tensor, ctx: StepContext, k_cache: torch.Tensor, v_cache: torch.Tensor,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [padded_rows, hidden] (normed) -> [padded_rows, hidden]: the attention output,
        plus `residual` when given (added in the output projection's epilogue)."""
        heads_q, heads_kv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = heads_q * hd, heads_kv * hd
        rows, meta, kernels = ctx.rows, ctx.meta, self.backend
        qkv = kernels.apply_linear(x, self.qkv)
        qk = None
        if self.qk_norm is not None:
            qk = qkv[:, : q_size + kv_size].view(-1, heads_q + heads_kv, hd)
            qk = kernels.rms_norm(qk, self.qk_norm, self.norm_eps)
        q = kernels.rope_write_kv(qkv, rows, ctx.rope, k_cache, v_cache, meta.slots, heads_q, heads_kv, hd, qk)
        nd = meta.num_decode
        if nd == rows:
            o = kernels.decode_attention(
                q, k_cache, v_cache, meta.decode_page_table, meta.decode_seq_lens, self.scale, ctx.prepared_decode
            )
        elif nd == 0:
            o = kernels.extend_attention(
                q, k_cache, v_cache, meta.extend_page_table,
                meta.extend_prefix_lens, meta.extend_lens, self.scale, ctx.prepared_extend,
            )  # fmt: skip
        else:
            o = torch.cat(
                (
                    kernels.decode_attention(
                        q[:nd], k_cache, v_cache, meta.decode_page_table,
                        meta.decode_seq_lens, self.scale, ctx.prepared_decode,
                    ),  # fmt: skip
                    kernels.extend_attention(
                        q[nd:], k_cache, v_cache, meta.extend_page_table,
                        meta.extend_prefix_lens, meta.extend_lens, self.scale, ctx.prepared_extend,
                    ),  # fmt: skip
                )
            )
        o = o.reshape(rows, q_size)
        if ctx.padded_rows > rows:
            o = F.pad(o, (0, 0, 0, ctx.padded_rows - rows))
        return kernels.apply_linear(o, self.o, residual)


class DenseMLP:
    """SiLU-gated MLP, gate and up fused into one matmul: down(silu(gate(x)) * up(x))."""

    def __init__(
        self,
        gate_up: torch.Tensor | QuantizedWeight | LinearWeight,  # [2 * intermediate, hidden], gate rows first
        down: torch.Tensor | QuantizedWeight | LinearWeight,  # [hidden, intermediate]
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,  # the activations' (default: the weights')
        backend: KernelBackend | None = None,
    ) -> None:
        dtype = dtype or (down.dtype if isinstance(down, torch.Tensor) else torch.bfloat16)
        self.backend = kernels = backend or TorchBackend()
        self.gate_up = kernels.prepare_linear(gate_up, gate_up_bias, dtype)
        self.down = kernels.prepare_linear(down, down_bias, dtype)
        self.intermediate_size = down.shape[1]

    def weights(self) -> list[torch.Tensor]:
        return [*self.gate_up.tensors(), *self.down.tensors()]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """down(silu(gate) * up) (+ residual, added in the down projection's epilogue)."""
        kernels = self.backend
        return kernels.apply_linear(kernels.silu_mul(kernels.apply_linear(x, self.gate_up)), self.down, residual)
