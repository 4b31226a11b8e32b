"""Attention on the CPU backend: the C++ paged decode kernel, and short extends through it.

The kernel reads each sequence's keys and values from the pool's pages where they lie (the
reference gathers every sequence's whole context into a new tensor in every layer, then
runs a masked SDPA), shares each key/value load between the query heads of a group, and
keeps the softmax in float32.

A short extend (a few new tokens per sequence, e.g. a speculative-decoding verify step) is
the decode problem once per new token: token j of a sequence with p cached tokens sees
p + j + 1 keys. `plan_short_extend` turns it into decode rows (the page-table row repeated,
one length per token), so it can run on the same kernel. Prompt chunks run on the extend
kernel (one (new token, query head) pair per vector lane, online softmax over the pages;
head_dim 64 / 128): extend_attention_avx512.cpp for bfloat16 on the AVX-512 build, 0.19-0.24x
the reference's time per layer (gather + SDPA) at 256-512 new tokens or 128 over 640 cached
(SmolLM2's heads, 2 threads); extend_attention_avx2.cpp (float32 FMAs, 8 lanes) for the
AVX2 build and for float32 queries on either. A short extend goes there too when its lanes
are full enough (`fills_extend_lanes`): decode rows read every key once per new token, the
extend kernel once per vector of lanes. Anything else stays on the SDPA paths
(engine/kernels/batched_extend.py, reference.py).

Every function that runs a kernel takes the kernels module (engine/kernels/cpu_ext.py's
build) as its first argument; engine/kernels/cpu_backend.py holds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from preheat.engine.kernels import kv_fp8, reference

# New tokens per sequence up to which an extend may run as decode rows.
SHORT_EXTEND = 16
# Where the extend kernel takes a short extend: at least this many of a vector's lanes used,
# on average over the extend, by the kernel's lanes a vector (extend_kernel_lanes). 16 lanes
# (the AVX-512 build, bfloat16): one vector of lanes (every key read once for it) cost what
# decode rows for 4.3 (head_dim 64, no grouping), 6.2 (SmolLM2: 3 query heads a kv head) and
# 10.5 (head_dim 128, 4 a group) (new token, head) pairs cost: measured at contexts of 600,
# 1 and 7 sequences, 2 threads, Zen 4 (SmolLM2's 5-token verify: 2.1x faster there). 8 lanes
# (the AVX2 kernel, float32 FMAs; 2026-12-07, same host and contexts, the AVX2 build forced):
# 6 of 8 lanes took 0.76-1.03x the decode rows' time (SmolLM2, 2-token verifies), 8 of 8
# 0.59-1.42x (head_dim 128, 4 a group; 0.91x on average), 4.5 of 8 0.92-1.26x, 3 or 4 of 8
# 1.05-1.96x.
EXTEND_KERNEL_MIN_FILL = {16: 9, 8: 6}


def eligible(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these queries and this cache (else the reference runs)."""
    num_heads, hd = q.shape[1:]
    kvh = k_cache.shape[2]
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and (k_cache.dtype == q.dtype or kv_fp8.is_fp8_kv(k_cache))
        and hd % 16 == 0
        and hd <= 256
        and num_heads % kvh == 0
        and num_heads // kvh <= 16
    )


def decode_attention(kernels: ModuleType, q, k_cache, v_cache, page_table, seq_lens, scale) -> torch.Tensor:
    """q [B, H, hd] -> [B, H, hd]; see docs/engine-internals.md for the layouts."""
    if not eligible(q, k_cache):
        return reference.decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    # An fp8 cache is read in place; its scales are folded into the kernel's (see kv_fp8.py).
    return kernels.decode_attention(q, k_cache, v_cache, page_table, seq_lens.to(torch.int32), scale,
                                    kv_fp8.scale_value(k_cache), kv_fp8.scale_value(v_cache))


def extend_kernel_lanes(kernels: ModuleType, dtype: torch.dtype) -> int:
    """(new token, query head) pairs in one vector of the extend kernel these queries run on:
    16 on the AVX-512 build's bfloat16 kernel, 8 on the AVX2 kernel (which the AVX-512 build
    hands float32 queries)."""
    return 16 if getattr(kernels, "isa", "") == "avx512" and dtype == torch.bfloat16 else 8


def fills_extend_lanes(extend_lens: list[int], group: int, width: int = 16) -> bool:
    """Whether the extend kernel's vectors, `width` (new token, query head) pairs each, are
    full enough for it to beat decode rows on this extend (`group`: query heads per kv head)."""
    lanes = sum(e * group for e in extend_lens)
    vectors = sum(-(-e * group // width) for e in extend_lens)
    return lanes >= EXTEND_KERNEL_MIN_FILL[width] * vectors


@dataclass
class ShortExtend:
    """A short extend laid out as decode rows (one page-table row and one length per new
    token), with the lengths the extend kernel reads should it take it instead."""

    page_table: torch.Tensor  # int32 [T, max_pages]
    seq_lens: torch.Tensor  # int32 [T]
    prefix_lens: torch.Tensor  # int32 [B]
    extend_lens: torch.Tensor  # int32 [B]
    _fills: dict[tuple[int, int], bool] = field(default_factory=dict)

    def on_extend_kernel(self, kernels: ModuleType, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether this layer runs it on the extend kernel (decided once per group size and
        lane width)."""
        if not long_extend_eligible(kernels, q, k_cache):
            return False
        key = (q.shape[1] // k_cache.shape[2], extend_kernel_lanes(kernels, q.dtype))
        if key not in self._fills:
            self._fills[key] = fills_extend_lanes(self.extend_lens.tolist(), *key)
        return self._fills[key]


def plan_short_extend(
    page_table: torch.Tensor | None, prefix_lens: list[int], extend_lens: list[int]
) -> ShortExtend | None:
    """The decode-row form of an extend whose sequences each bring <= SHORT_EXTEND tokens,
    or None (a long extend)."""
    if page_table is None or not extend_lens or max(extend_lens) > SHORT_EXTEND:
        return None
    counts = torch.tensor(extend_lens, dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(extend_lens)), counts)
    lens = [p + j + 1 for p, e in zip(prefix_lens, extend_lens) for j in range(e)]
    return ShortExtend(
        page_table.index_select(0, rows.to(page_table.device)).to(torch.int32),
        torch.tensor(lens, dtype=torch.int32, device=page_table.device),
        torch.tensor(prefix_lens, dtype=torch.int32),
        counts.to(torch.int32),
    )


def short_extend(kernels: ModuleType, q, k_cache, v_cache, plan: ShortExtend, scale,
                 page_table: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """A short extend on the extend kernel where it fills its lanes (and `page_table`, the
    sequences' own, is given), else as decode rows."""
    if page_table is not None and plan.on_extend_kernel(kernels, q, k_cache):
        return long_extend(kernels, q, k_cache, v_cache, page_table, plan.prefix_lens, plan.extend_lens, scale)
    return decode_attention(kernels, q, k_cache, v_cache, plan.page_table, plan.seq_lens, scale)


@dataclass
class LongExtend:
    """A prompt-chunk extend: the lengths the extend kernel reads, and the PyTorch backend's
    plan for what it does not take (made only when asked: `fallback`)."""

    prefix_lens: torch.Tensor  # int32 [B]
    extend_lens: torch.Tensor  # int32 [B]
    make_fallback: Callable[[], Any]
    _fallback: Any = None
    _made: bool = False

    def fallback(self) -> Any:
        if not self._made:
            self._fallback, self._made = self.make_fallback(), True
        return self._fallback


def long_extend_eligible(kernels: ModuleType, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the extend kernel takes these queries and this cache: bfloat16 or float32
    queries (bfloat16 ones even-strided: read in pairs), pages of their dtype or fp8,
    head_dim 64 or 128, whole query groups."""
    return (
        getattr(kernels, "has_extend_attention", False)
        and q.device.type == "cpu"
        and q.dtype in (torch.bfloat16, torch.float32)
        and (k_cache.dtype == q.dtype or kv_fp8.is_fp8_kv(k_cache))
        and q.shape[-1] in (64, 128)
        and q.shape[1] % k_cache.shape[2] == 0
        and q.stride(-1) == 1
        and (q.dtype == torch.float32 or (q.stride(0) % 2 == 0 and q.stride(1) % 2 == 0))
    )


def long_extend(kernels: ModuleType, q, k_cache, v_cache, page_table, prefix_lens: torch.Tensor,
                extend_lens: torch.Tensor, scale) -> torch.Tensor:  # fmt: skip
    """The extend kernel over int32 [B] lengths (LongExtend's). An fp8 cache is read in
    place, its scales folded into the kernel's as decode_attention folds them."""
    if page_table.dtype != torch.int32:
        page_table = page_table.to(torch.int32)
    return kernels.extend_attention(q, k_cache, v_cache, page_table, prefix_lens, extend_lens, scale,
                                    kv_fp8.scale_value(k_cache), kv_fp8.scale_value(v_cache))


def extend_attention(kernels: ModuleType, q, k_cache, v_cache, page_table, prefix_lens, extend_lens,
                     scale) -> torch.Tensor:  # fmt: skip
    prefix, extend = [int(p) for p in prefix_lens], [int(e) for e in extend_lens]
    plan = plan_short_extend(page_table, prefix, extend)
    if plan is not None and eligible(q, k_cache):
        return short_extend(kernels, q, k_cache, v_cache, plan, scale, page_table)
    if plan is None and page_table is not None and long_extend_eligible(kernels, q, k_cache):
        return long_extend(kernels, q, k_cache, v_cache, page_table, torch.tensor(prefix, dtype=torch.int32),
                           torch.tensor(extend, dtype=torch.int32), scale)
    return reference.extend_attention(q, k_cache, v_cache, page_table, prefix_lens, extend_lens, scale)
