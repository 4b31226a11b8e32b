"""fp8 KV cache: storage dtypes, per-layer scales, and the PyTorch quantised store/load
(the CPU path, and the yardstick for the Triton kernels).

`--kv-cache-dtype` takes vLLM's spellings: `fp8` (= `fp8_e4m3`, float8_e4m3fn, ±448, 3
mantissa bits) and `fp8_e5m2` (float8_e5m2, ±57344, 2 mantissa bits). A stored value is
`clamp(x / scale, -max, max)` cast to the fp8 dtype; it reads back as `stored * scale`.

Scales are per layer, one for K and one for V, and *static, calibrated at start-up*
(engine/kv/fp8_calibration.py): the engine runs a fixed calibration text through the model
once into a small model-dtype pool, takes each layer's K and V absolute maximum, and sets
scale = amax * margin / max rounded up to a power of two (exact to multiply by, and the same
on every engine of a model, so snapshots and L3 pages stay valid between them: the scales
are part of the model fingerprint). Values already in the pool were divided by the scale,
so it never changes while they live. A scale is a float32 [1] tensor on the pool's device
rather than a Python float, so a captured CUDA graph reads it from memory.

The pool hands each layer's cache out as a view carrying its scale (`cache.kv_scale`, see
`scale_of`), so the write and attention paths find it without another argument.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAXES = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the KV pool is allocated in for `--kv-cache-dtype`, on any device."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in FP8_DTYPES:
        if kv_cache_dtype == "fp8_e5m2" and torch.device(device).type == "cuda":
            raise ValueError("--kv-cache-dtype fp8_e5m2: the Triton kernels store e4m3 only; use fp8 on CUDA")
        return FP8_DTYPES[kv_cache_dtype]
    raise ValueError(f"--kv-cache-dtype: unknown value {kv_cache_dtype!r}")


def is_fp8(t: torch.Tensor) -> bool:
    """An e4m3 cache (what the Triton kernels quantise to)."""
    return t.dtype == FP8_DTYPE


def is_fp8_kv(t: torch.Tensor) -> bool:
    """Any fp8 cache, e4m3 or e5m2."""
    return t.dtype in FP8_MAXES


def scale_of(cache: torch.Tensor) -> torch.Tensor | None:
    """The scale an fp8 cache view carries (engine/kv/pool.py), None for other caches."""
    return getattr(cache, "kv_scale", None) if is_fp8_kv(cache) else None


def scale_value(cache: torch.Tensor) -> float:
    """scale_of as the CPU kernels take it: a number, 1.0 where there is none (a cache of the
    model's dtype, or an fp8 view without one, whose values are stored as they are)."""
    scale = scale_of(cache)
    return 1.0 if scale is None else float(scale)


def load(x: torch.Tensor, cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values gathered from `cache` in `dtype`: dequantised when it is an fp8 cache."""
    scale = scale_of(cache)
    if scale is None:
        return x.to(dtype)
    return (x.to(torch.float32) * scale).to(dtype)


def store(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """`x` as `cache` stores it: quantised with the cache's scale for an fp8 cache."""
    if not is_fp8_kv(cache):
        return x.to(cache.dtype)
    scale = scale_of(cache)
    top = FP8_MAXES[cache.dtype]
    y = x.float() if scale is None else x.float() / scale
    return y.clamp(-top, top).to(cache.dtype)


def power_of_two_scale(amax: float, fp8_dtype: torch.dtype, margin: float = 2.0) -> float:
    """The calibrated scale for a K or V absolute maximum: `amax * margin` maps at most to
    the dtype's largest value, rounded up to a power of two."""
    import math

    want = max(amax, 1e-6) * margin / FP8_MAXES[fp8_dtype]
    return 2.0 ** math.ceil(math.log2(want))


def calibrated_scale(x: torch.Tensor, margin: float = 2.0) -> torch.Tensor:
    """A scale that maps |x|.max() * margin to FP8_MAX: for calibrating on warmup activations.

    The margin leaves headroom for activations larger than the ones calibrated on.
    """
    amax = x.detach().abs().amax().float().clamp_min(1e-6)
    return (amax * margin / FP8_MAX).reshape(1)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale.float()).to(dtype)


def write_kv_fp8_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """write_kv for an fp8 pool: quantise, then store at `slots` (same layout as write_kv)."""
    kvh, hd = k_cache.shape[-2:]
    k_cache.view(-1, kvh, hd)[slots.long()] = quantize_fp8(k, k_scale)
    v_cache.view(-1, kvh, hd)[slots.long()] = quantize_fp8(v, v_scale)
