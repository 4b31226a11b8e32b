"""The one dispatch point for attention over the paged KV pool.

The model calls only these functions (and the prepare_* hooks, once per forward pass).
Which implementation runs (our C++ kernels on a CPU with AVX-512 VNNI/BF16, the PyTorch
reference on other CPUs, Triton kernels on CUDA) is chosen once per process by
`set_backend`, which the engine calls with the device it runs on, before it loads the
weights (the linear layers' form depends on it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from preheat.engine.kernels import batched_extend, cpu_attention, kv_fp8, reference

log = logging.getLogger(__name__)

_impl: dict[str, Callable] = {
    "write_kv": reference.write_kv,
    "decode_attention": reference.decode_attention,
    "extend_attention": reference.extend_attention,
}
backend_name = "torch"


def set_backend(device: torch.device, prefer_triton: bool = True) -> str:
    """Chooses the implementation for this process; returns its name."""
    global backend_name
    from preheat.engine.kernels import fused, linear

    _impl.update(
        write_kv=reference.write_kv,
        decode_attention=reference.decode_attention,
        extend_attention=reference.extend_attention,
    )
    backend_name = "torch"
    linear.use_kernels(None)
    fused.use_kernels(None)
    cpu_attention.use_kernels(None)
    from preheat.engine.kernels.backend import select_attention_backend

    chosen = select_attention_backend(device) if prefer_triton else "torch"
    if chosen == "cpu":
        from preheat.engine.kernels import cpu_ext

        module = cpu_ext.load()
        cpu_attention.use_kernels(module)
        linear.use_kernels(module)
        fused.use_kernels(module)
        _impl.update(decode_attention=cpu_attention.decode_attention, extend_attention=cpu_attention.extend_attention)
        backend_name = "cpu"
    if chosen == "triton":
        try:
            from preheat.engine.kernels import triton_attention, triton_kv

            _impl.update(
                write_kv=triton_kv.write_kv,
                decode_attention=triton_attention.decode_attention,
            )
            backend_name = "triton"
        except Exception as exc:  # a missing or broken Triton must not stop serving
            log.warning("Triton kernels unavailable (%s); using PyTorch attention", exc)
    return backend_name


def _scales(k_cache, v_cache) -> dict:
    """An fp8 cache's scales, as the Triton kernels take them (the torch path reads them
    off the cache itself, engine/kernels/kv_fp8.py)."""
    ks = kv_fp8.scale_of(k_cache)
    return {} if ks is None or backend_name != "triton" else {"k_scale": ks, "v_scale": kv_fp8.scale_of(v_cache)}


def write_kv(k_cache, v_cache, k, v, slots) -> None:
    _impl["write_kv"](k_cache, v_cache, k, v, slots, **_scales(k_cache, v_cache))


def prepare_decode(page_table, seq_lens, page_size: int):
    """Per-batch work shared by every layer's decode attention (None when the backend
    needs none). Must not be called inside a CUDA-graph capture with the torch backend."""
    if backend_name != "torch":
        return None
    return reference.DecodeGather(page_table, seq_lens, page_size)


def prepare_extend(page_table, prefix_lens: list[int], extend_lens: list[int], page_size: int):
    """Per-batch work shared by every layer's extend attention: on the CPU backend, decode
    rows for a short extend (cpu_attention.py); a plan for the batched torch path; or None
    when padding would waste too much (the per-sequence one runs)."""
    if backend_name == "cpu":
        short = cpu_attention.plan_short_extend(page_table, prefix_lens, extend_lens)
        if short is not None:
            return short
    groups = batched_extend.groups_worth_batching(prefix_lens, extend_lens)
    if groups is None:
        return None
    return batched_extend.plan_extend(page_table, prefix_lens, extend_lens, page_size, groups)


def decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale, prepared=None) -> torch.Tensor:
    if prepared is not None:
        return reference.decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale, prepared)
    return _impl["decode_attention"](q, k_cache, v_cache, page_table, seq_lens, scale, **_scales(k_cache, v_cache))


def extend_attention(q, k_cache, v_cache, page_table, prefix_lens, extend_lens, scale, prepared=None) -> torch.Tensor:
    if isinstance(prepared, cpu_attention.ShortExtend):
        return cpu_attention.short_extend(q, k_cache, v_cache, prepared, scale)
    if prepared is not None:
        return batched_extend.extend_attention(q, k_cache, v_cache, prepared, scale)
    return _impl["extend_attention"](q, k_cache, v_cache, page_table, prefix_lens, extend_lens, scale)
