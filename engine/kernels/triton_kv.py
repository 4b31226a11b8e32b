"""Triton kernel that writes new K/V rows into the paged pool (optionally fp8-quantised).

Same contract as `write_kv` in docs/engine-internals.md:
    k_cache, v_cache: [num_pages, page_size, kvh, hd]; k, v: [T, kvh, hd]; slots: int64 [T]
A slot is `page * page_size + offset`. Padding rows carry slot 0..page_size-1 (scratch
page 0), so the kernel writes every row unconditionally: no host-side masking, which keeps
it capturable in a CUDA graph.

fp8: when the cache dtype is float8_e4m3fn, each value is divided by the per-tensor scale
(a float32 [1] tensor, see kv_fp8.py), clamped to ±448, rounded to nearest even and cast:
bit-identical to kv_fp8.quantize_fp8. Other cache dtypes are a plain cast.

Import this module only where Triton is importable (backend.py decides); tests run it on
CPU with TRITON_INTERPRET=1 set before the import.
"""

from __future__ import annotations

import torch

from preheat.engine.kernels.kv_fp8 import FP8_MAX, is_fp8
from preheat.engine.kernels.triton_import import tl, triton


@triton.jit
def _round_to_e4m3(x):
    """Rounds fp32 values in [-448, 448] to the nearest float8_e4m3fn value (ties to even).

    The cast that follows is then exact, so the stored bits are the ones torch produces.
    Doing it by hand because the Triton interpreter's fp32->fp8 cast drops the carry when
    rounding overflows the mantissa (31.6 becomes 16) and rounds ties away from zero.
    """
    # Normal range: keep 3 of fp32's 23 mantissa bits, round to nearest even on the bits;
    # an integer add carries into the exponent correctly.
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)  # -1048576 = ~0xFFFFF
    # Subnormal range (|x| < 2**-6): a fixed step of 2**-9. Adding and removing 1.5 * 2**14,
    # whose fp32 ulp is 2**-9, makes the FPU round to that step (ties to even). Done on |x|
    # and signed afterwards so a tiny negative value becomes -0, as torch stores it.
    magic = 24576.0
    sub = (tl.abs(x) + magic) - magic
    sub = tl.where(x < 0, -sub, sub)
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


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
        k = _round_to_e4m3(tl.clamp(k.to(tl.float32) / tl.load(KScale), -QMAX, QMAX))
        v = _round_to_e4m3(tl.clamp(v.to(tl.float32) / tl.load(VScale), -QMAX, QMAX))
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


# The name TritonBackend binds (engine/kernels/triton_backend.py; reference.write_kv's signature).
write_kv = write_kv_triton
