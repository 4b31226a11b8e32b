"""Triton kernel that writes new K/V rows into the paged pool (optionally fp8-quantised).

Same contract as `write_kv` in docs/engine-internals.md:
    k_cache, v_cache: [num_pages, page_size, kvh, hd]; k, v: [T, kvh, hd]; slots: int64 [T]
A slot is `page * page_size + offset`. Padding rows carry slot 0..page_size-1 (scratch
page 0), so the kernel writes every row unconditionally: no host-side masking, which keeps
it capturable in a CUDA graph.

fp8: when the cache dtype is float8_e4m3fn, each value is divided by the per-tensor scale
(a float32 [1] tensor, see kv_fp8.py), clamped to ±448 and cast; other cache dtypes are a
plain cast.

Import this module only where Triton is importable (attention.py decides); tests run it on
CPU with TRITON_INTERPRET=1 set before the import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_fp8 import FP8_MAX, is_fp8


@triton.jit
def _write_kv_kernel(
    K,
    V,
    KC,
    VC,
    Slots,
    KScale,
    VScale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cp,  # cache strides (K and V caches share a layout: they are views of one pool)
    stride_cs,
    stride_ch,
    PAGE_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)  # int64: page * page_size can pass 2**31 on big pools
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    dst = page * stride_cp + off * stride_cs + h[:, None] * stride_ch + d[None, :]

    k = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if QUANT:
        k = tl.clamp(k.to(tl.float32) / tl.load(KScale), -QMAX, QMAX)
        v = tl.clamp(v.to(tl.float32) / tl.load(VScale), -QMAX, QMAX)
    tl.store(KC + dst, k.to(KC.dtype.element_ty), mask=mask)
    tl.store(VC + dst, v.to(VC.dtype.element_ty), mask=mask)


def write_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Stores k[t], v[t] at slots[t]. k_scale/v_scale are required for an fp8 cache."""
    num_tokens, kvh, hd = k.shape
    if num_tokens == 0:
        return
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[-2:] == (kvh, hd) and v.shape == k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1
    quant = is_fp8(k_cache)
    if quant and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    # Unused pointers still need a tensor; the slots tensor is a harmless stand-in.
    ks = k_scale if quant else slots
    vs = v_scale if quant else slots
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        ks,
        vs,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        PAGE_SIZE=k_cache.shape[1],
        NUM_HEADS=kvh,
        HEAD_DIM=hd,
        BLOCK_H=triton.next_power_of_2(kvh),
        BLOCK_D=triton.next_power_of_2(hd),
        QUANT=quant,
        QMAX=FP8_MAX,
    )
