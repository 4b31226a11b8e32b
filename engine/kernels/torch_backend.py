"""The PyTorch backend: every operation of the contract (engine/kernels/backend.py) as the
reference computes it. It runs on a CPU without our kernels, on CUDA without Triton, and
under PREHEAT_ATTENTION_BACKEND=torch; the other backends subclass it and replace only what
they have kernels for, so everything else is this code.
"""

from __future__ import annotations

import torch

from preheat.engine.kernels import batched_extend, fused, int8, linear, reference
from preheat.engine.kernels.fused import RopeInputs
from preheat.engine.kernels.linear import LinearWeight


class TorchBackend:
    """Stateless: one instance may serve any number of models (shapes in backend.py)."""

    name = "torch"
    # oneDNN builds (and caches) a matmul kernel per shape: CPU forward passes run at
    # bucketed row counts (engine/model/decoder.py's padded_rows).
    pad_cpu_rows = True

    # ---------------------------------------------------------------- attention
    def write_kv(self, k_cache, v_cache, k, v, slots) -> None:
        reference.write_kv(k_cache, v_cache, k, v, slots)

    def prepare_decode(self, page_table, seq_lens, page_size: int):
        """The slots and mask every layer's gathered-context decode reads. Syncs with the
        host (int(seq_lens.max())): never inside a CUDA-graph capture."""
        return reference.DecodeGather(page_table, seq_lens, page_size)

    def prepare_extend(self, page_table, prefix_lens: list[int], extend_lens: list[int], page_size: int):
        """A plan for the batched SDPA path, or None when padding would waste too much (the
        per-sequence reference runs)."""
        groups = batched_extend.groups_worth_batching(prefix_lens, extend_lens)
        if groups is None:
            return None
        return batched_extend.plan_extend(page_table, prefix_lens, extend_lens, page_size, groups)

    def decode_attention(self, q, k_cache, v_cache, page_table, seq_lens, scale, prepared=None) -> torch.Tensor:
        return reference.decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale, prepared)

    def extend_attention(self, q, k_cache, v_cache, page_table, prefix_lens, extend_lens, scale,
                         prepared=None) -> torch.Tensor:  # fmt: skip
        if prepared is not None:
            return batched_extend.extend_attention(q, k_cache, v_cache, prepared, scale)
        return reference.extend_attention(q, k_cache, v_cache, page_table, prefix_lens, extend_lens, scale)

    # ---------------------------------------------------------------- linear layers
    def prepare_linear(self, weight: torch.Tensor | int8.QuantizedWeight | LinearWeight, bias: torch.Tensor | None,
                       dtype: torch.dtype) -> LinearWeight:  # fmt: skip
        return linear.prepare(weight, bias, dtype)

    def apply_linear(self, x: torch.Tensor, w: LinearWeight, residual: torch.Tensor | None = None) -> torch.Tensor:
        return linear.apply(x, w, residual)

    # ---------------------------------------------------------------- element-wise
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return fused.rms_norm(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return fused.silu_mul(gate_up)

    def rope_inputs(self, rope, positions: torch.Tensor, head_dim: int) -> RopeInputs:
        return RopeInputs(rope, positions, head_dim)

    # ---------------------------------------------------------------- sampling
    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(-1)

    def rope_write_kv(self, qkv, rows: int, rope: RopeInputs, k_cache, v_cache, slots, num_heads: int,
                      num_kv_heads: int, head_dim: int, qk=None) -> torch.Tensor:  # fmt: skip
        q, k, v = fused.rotate_qkv(qkv, rows, rope, num_heads, num_kv_heads, head_dim, qk)
        self.write_kv(k_cache, v_cache, k, v, slots)
        return q
