"""fp8_e4m3 KV cache: storage dtype, per-tensor scales, and the PyTorch reference of the
quantised store/load (the CPU path and the yardstick for the Triton kernels).

A stored value is `clamp(x / scale, -448, 448)` cast to float8_e4m3fn; it reads back as
`stored * scale`. The scale is per tensor (one for K, one for V, per layer) and *static*:
values already in the pool were divided by it, so it must not change while they live.
It is a float32 tensor of shape [1] on the pool's device rather than a Python float so a
captured CUDA graph reads it from memory (a float would be frozen into the graph), and so a
calibrated value can be loaded in place later. The default 1.0 is what vLLM and SGLang use
without calibration: K/V activations of bf16 Llama-family models sit well inside ±448, and
the clamp keeps an outlier from turning into NaN (e4m3fn has no inf; overflow is NaN).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the KV pool is allocated in for `--kv-cache-dtype`.

    fp8 is GPU only (see engine/config.py): on CPU there is no fp8 arithmetic worth having,
    so asking for it there is a configuration error rather than a silent fallback.
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8_e4m3":
        if torch.device(device).type != "cuda":
            raise ValueError("--kv-cache-dtype fp8_e4m3 needs a CUDA device; use auto on CPU")
        return FP8_DTYPE
    raise ValueError(f"--kv-cache-dtype: unknown value {kv_cache_dtype!r}")


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


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
