"""The CPU backend: our C++ kernels (engine/kernels/cpu_ext.py: the AVX-512 VNNI/BF16 or the AVX2 build) for decode
attention over the pages and short extends through it (engine/kernels/cpu_attention.py),
the matrix multiplies (weights packed once, engine/kernels/linear.py), RMSNorm, the SiLU
gate, and RoPE together with the KV write. Whatever a kernel does not take (a dtype, a
head size, a layout) runs as the PyTorch backend it extends runs it.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from preheat.engine.kernels import cpu_attention, cpu_ext, int8, kv_fp8, linear, reference
from preheat.engine.kernels.fused import RopeInputs
from preheat.engine.kernels.linear import LinearWeight
from preheat.engine.kernels.torch_backend import TorchBackend

log = logging.getLogger(__name__)


def int8_activation_bits_for(kernels: ModuleType, wanted: int) -> int:
    """The activation width an int8 multiply runs at on this build: `wanted`, or 16 where the
    build does not run `wanted` (its `int8_activation_bits_choices`)."""
    if wanted not in getattr(kernels, "int8_activation_bits_choices", (16,)):
        log.warning("--int8-activation-bits %d needs the avx512 kernels (this is the %s build); using 16",
                    wanted, getattr(kernels, "isa", "?"))
        return 16
    return wanted


class CpuKernelBackend(TorchBackend):
    name = "cpu"
    pad_cpu_rows = False  # the kernels need no kernel per shape (oneDNN does)

    def __init__(self, kernels: ModuleType, dense_from_rows: dict[str, int] | None = None,
                 int8_activation_bits: int = 16) -> None:  # fmt: skip
        """`kernels`: one build of the extension (cpu_ext.load(), or a submodule of build()).
        `dense_from_rows`: where long prompts multiply through dense rows
        (cpu_ext.dense_prefill_rows; default: decided from this CPU's flags).
        `int8_activation_bits`: --int8-activation-bits; 8 on a build without it (AVX2) runs
        16, said once in the log."""
        self.kernels = kernels
        if dense_from_rows is None:
            amx = getattr(kernels, "amx", None)
            dense_from_rows = cpu_ext.dense_prefill_rows(cpu_ext.read_cpu_flags(), getattr(kernels, "isa", ""),
                                                         amx_kernels=bool(amx is not None and amx()))  # fmt: skip
        self.dense_from_rows = dense_from_rows
        self.int8_activation_bits = int8_activation_bits_for(kernels, int8_activation_bits)

    def _takes(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16)

    # ---------------------------------------------------------------- attention
    def prepare_decode(self, page_table, seq_lens, page_size: int):
        return None  # the kernel reads the pages where they lie: nothing to gather

    def prepare_extend(self, page_table, prefix_lens: list[int], extend_lens: list[int], page_size: int):
        """Decode rows for a short extend; else the extend kernel's lengths, with the PyTorch
        backend's plan made only if a layer's dtypes send it there."""
        short = cpu_attention.plan_short_extend(page_table, prefix_lens, extend_lens)
        if short is not None:
            return short
        if page_table is None or not getattr(self.kernels, "has_extend_attention", False):
            return super().prepare_extend(page_table, prefix_lens, extend_lens, page_size)
        return cpu_attention.LongExtend(
            torch.tensor(prefix_lens, dtype=torch.int32), torch.tensor(extend_lens, dtype=torch.int32),
            lambda: TorchBackend.prepare_extend(self, page_table, prefix_lens, extend_lens, page_size),
        )

    def decode_attention(self, q, k_cache, v_cache, page_table, seq_lens, scale, prepared=None) -> torch.Tensor:
        if prepared is not None:
            return reference.decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale, prepared)
        return cpu_attention.decode_attention(self.kernels, q, k_cache, v_cache, page_table, seq_lens, scale)

    def extend_attention(self, q, k_cache, v_cache, page_table, prefix_lens, extend_lens, scale,
                         prepared=None) -> torch.Tensor:  # fmt: skip
        if isinstance(prepared, cpu_attention.ShortExtend):
            return cpu_attention.short_extend(self.kernels, q, k_cache, v_cache, prepared, scale, page_table)
        if isinstance(prepared, cpu_attention.LongExtend):
            if cpu_attention.long_extend_eligible(self.kernels, q, k_cache):
                return cpu_attention.long_extend(self.kernels, q, k_cache, v_cache, page_table, prepared.prefix_lens,
                                                 prepared.extend_lens, scale)
            prepared = prepared.fallback()
            if prepared is None:
                return reference.extend_attention(q, k_cache, v_cache, page_table, prefix_lens, extend_lens, scale)
        if prepared is not None:
            return super().extend_attention(q, k_cache, v_cache, page_table, prefix_lens, extend_lens, scale, prepared)
        return cpu_attention.extend_attention(self.kernels, q, k_cache, v_cache, page_table, prefix_lens,
                                              extend_lens, scale)  # fmt: skip

    # ---------------------------------------------------------------- linear layers
    def prepare_linear(self, weight: torch.Tensor | int8.QuantizedWeight | LinearWeight, bias: torch.Tensor | None,
                       dtype: torch.dtype) -> LinearWeight:  # fmt: skip
        return linear.prepare(weight, bias, dtype, self.kernels, self.dense_from_rows, self.int8_activation_bits)

    # ---------------------------------------------------------------- element-wise
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._takes(x) and x.dim() == 2 and x.stride(-1) == 1 and weight.dim() == 1 and weight.dtype == x.dtype:
            return self.kernels.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._takes(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            return self.kernels.silu_mul(gate_up)
        return super().silu_mul(gate_up)

    # ---------------------------------------------------------------- sampling
    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's argmax_rows for float32 logits (torch's argmax read a 49k-token row
        at ~7 GB/s: ~28 us a row, ~0.1 ms a step at 8 rows); torch's otherwise."""
        if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0 and x.stride(-1) == 1:
            return self.kernels.argmax_rows(x)
        return super().argmax(x)

    def rope_inputs(self, rope, positions: torch.Tensor, head_dim: int) -> RopeInputs:
        use_kernel = (
            positions.device.type == "cpu" and rope.dtype in (torch.float32, torch.bfloat16) and head_dim % 32 == 0
        )
        return RopeInputs(rope, positions, head_dim, use_kernel)

    def rope_write_kv(self, qkv, rows: int, rope: RopeInputs, k_cache, v_cache, slots, num_heads: int,
                      num_kv_heads: int, head_dim: int, qk=None) -> torch.Tensor:  # fmt: skip
        fp8 = kv_fp8.is_fp8_kv(k_cache)
        if rope.use_kernel and (qkv.dtype == k_cache.dtype or fp8) and qkv.stride(-1) == 1 and k_cache.is_contiguous():
            if qk is not None:
                qk_size = (num_heads + num_kv_heads) * head_dim
                qkv = torch.cat((qk.reshape(qkv.shape[0], qk_size), qkv[:, qk_size:]), dim=1)
            # An fp8 cache is written by the kernel too, each value x / scale rounded as
            # kv_fp8.store rounds it (the same bytes).
            return self.kernels.rope_kv(
                qkv, rows, num_heads, num_kv_heads, rope.table, rope.positions, slots, k_cache, v_cache,
                kv_fp8.scale_value(k_cache), kv_fp8.scale_value(v_cache),
            )
        return super().rope_write_kv(qkv, rows, rope, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim, qk)
