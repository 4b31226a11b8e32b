"""A layer's element-wise work in PyTorch: RMSNorm, the SiLU gate, and the rotary step of the
fused q/k/v projection. Pure functions, the reference every backend is checked against.

These are the PyTorch backend's (engine/kernels/torch_backend.py) and the GPU path's
(unchanged); the CPU backend (engine/kernels/cpu_backend.py) runs each as one C++ pass over
its rows instead of a handful of tensor ops, rounding in bfloat16 exactly where these round,
so both agree to the last bit up to float32 summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from preheat.engine.kernels.rope import apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalise in float32, cast back, then scale."""
    # torch's fused rms_norm gives bit-identical results with half the kernel launches.
    # `weight` broadcasts over the last dimensions of x (a [heads, head_dim] weight scales
    # each head by its own).
    return weight * F.rms_norm(x.to(torch.float32), x.shape[-1:], eps=eps).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RopeInputs:
    """What every layer's rotary step needs for one forward pass, worked out once (a
    backend's `rope_inputs` makes it: only it knows whether its kernel reads a table)."""

    def __init__(self, rope, positions: torch.Tensor, head_dim: int, use_kernel: bool = False) -> None:
        """`rope` is the model's RotaryEmbedding (engine/kernels/rope.py): rope(positions) ->
        (cos, signed sin), and rope.table(n) -> [n, 2 * head_dim] rows of both for positions
        0..n-1, which a kernel (`use_kernel`) looks up instead."""
        self.positions = positions
        self.use_kernel = use_kernel
        self._rope = rope
        if use_kernel:
            self.table = rope.table(int(positions.max()) + 1 if positions.numel() else 1)
        else:
            self.cos, self.sin = rope(positions)

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of the rows, worked out on first use where the kernel had the
        table instead (a step the kernel does not take runs the PyTorch path)."""
        if not hasattr(self, "cos"):
            self.cos, self.sin = self._rope(self.positions)
        return self.cos, self.sin


def rotate_qkv(
    qkv: torch.Tensor, rows: int, rope: RopeInputs, num_heads: int, num_kv_heads: int, head_dim: int,
    qk: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rotary step of a fused qkv projection [T, (H + 2 KVH) D]: (q [rows, H, D] and
    k [rows, KVH, D] rotated, v [rows, KVH, D]). `qk`, when given ([T, H + KVH, D], e.g.
    after Qwen3's per-head norm), replaces qkv's q and k."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if qk is None:
        qk = qkv[:, : q_size + kv_size].view(-1, num_heads + num_kv_heads, head_dim)
    # q and k rotated in one pass (half the ops per layer).
    qk = apply_rope(qk, *rope.cos_sin())
    q, k = qk[:rows].split([num_heads, num_kv_heads], dim=1)
    v = qkv[:rows, q_size + kv_size :].view(-1, num_kv_heads, head_dim)
    return q, k, v
