"""The one dispatch point for a layer's element-wise work: RMSNorm, the SiLU gate, and rotary
embedding together with the KV-cache write.

The PyTorch versions here are the reference (and the GPU path, unchanged); with the CPU
kernels each is one call doing one pass over its rows instead of a handful of tensor ops
(the rotary one also writes K and V into the pool, so the step needs no separate write).
Both round in bfloat16 exactly where the other rounds, so they agree to the last bit up to
float32 summation order.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from preheat.engine.kernels import attention
from preheat.engine.kernels.rope import apply_rope

_kernels: ModuleType | None = None


def use_kernels(module: ModuleType | None) -> None:
    """Called by attention.set_backend: the CPU kernels module, or None for PyTorch."""
    global _kernels
    _kernels = module


def _kernel_dtype(t: torch.Tensor) -> bool:
    return _kernels is not None and t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalise in float32, cast back, then scale."""
    if _kernel_dtype(x) and x.dim() == 2 and x.stride(-1) == 1 and weight.dim() == 1 and weight.dtype == x.dtype:
        return _kernels.rms_norm(x, weight, eps)
    # torch's fused rms_norm gives bit-identical results with half the kernel launches.
    # `weight` broadcasts over the last dimensions of x (a [heads, head_dim] weight scales
    # each head by its own).
    return weight * F.rms_norm(x.to(torch.float32), x.shape[-1:], eps=eps).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    if _kernel_dtype(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return _kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RopeInputs:
    """What every layer's rotary step needs for one forward pass, worked out once."""

    def __init__(self, rope, positions: torch.Tensor, head_dim: int) -> None:
        """`rope` is the model's RotaryEmbedding: rope(positions) -> (cos, signed sin), and
        rope.table(n) -> [n, 2 * head_dim] rows of both for positions 0..n-1."""
        self.positions = positions
        self.use_kernel = (
            _kernels is not None
            and positions.device.type == "cpu"
            and rope.dtype in (torch.float32, torch.bfloat16)
            and head_dim % 32 == 0
        )
        self._rope = rope
        if self.use_kernel:
            self.table = rope.table(int(positions.max()) + 1 if positions.numel() else 1)
        else:
            self.cos, self.sin = rope(positions)

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of the rows, worked out on first use where the kernel had the
        table instead (an fp8 cache takes the PyTorch path: the kernel writes the model dtype)."""
        if not hasattr(self, "cos"):
            self.cos, self.sin = self._rope(self.positions)
        return self.cos, self.sin


def rope_write_kv(
    qkv: torch.Tensor, rows: int, rope: RopeInputs, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slots: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, qk: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotates the q and k parts of a fused qkv projection [T, (H + 2 KVH) D], writes k and v
    of the first `rows` rows into the caches at `slots`; returns q [rows, H, D]. `qk`, when
    given ([T, H + KVH, D], e.g. after Qwen3's per-head norm), replaces qkv's q and k."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if rope.use_kernel and qkv.dtype == k_cache.dtype and qkv.stride(-1) == 1 and k_cache.is_contiguous():
        if qk is not None:
            qkv = torch.cat((qk.reshape(qkv.shape[0], q_size + kv_size), qkv[:, q_size + kv_size :]), dim=1)
        return _kernels.rope_kv(
            qkv, rows, num_heads, num_kv_heads, rope.table, rope.positions, slots, k_cache, v_cache
        )
    if qk is None:
        qk = qkv[:, : q_size + kv_size].view(-1, num_heads + num_kv_heads, head_dim)
    # q and k rotated in one pass (half the ops per layer).
    qk = apply_rope(qk, *rope.cos_sin())
    q, k = qk[:rows].split([num_heads, num_kv_heads], dim=1)
    v = qkv[:rows, q_size + kv_size :].view(-1, num_kv_heads, head_dim)
    attention.write_kv(k_cache, v_cache, k, v, slots)
    return q
