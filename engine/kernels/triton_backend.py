"""The Triton backend (CUDA, or the interpreter under TRITON_INTERPRET=1 in tests): the KV
write and decode attention are Triton kernels (engine/kernels/triton_kv.py,
triton_attention.py) that read an fp8 cache's scales as tensors; extends, the linear layers
and the element-wise work run as the PyTorch backend runs them (cuBLAS, torch ops).
"""

from __future__ import annotations

import torch

from preheat.engine.kernels import kv_fp8, reference
from preheat.engine.kernels.torch_backend import TorchBackend


def _scales(k_cache, v_cache) -> dict:
    """An fp8 cache's scales, as the Triton kernels take them (the PyTorch path reads them
    off the cache itself, engine/kernels/kv_fp8.py)."""
    ks = kv_fp8.scale_of(k_cache)
    return {} if ks is None else {"k_scale": ks, "v_scale": kv_fp8.scale_of(v_cache)}


class TritonBackend(TorchBackend):
    name = "triton"

    def __init__(self) -> None:
        """Imports the kernel modules; raises when Triton is missing or broken (the caller
        falls back to the PyTorch backend)."""
        from preheat.engine.kernels import triton_attention, triton_kv

        self._write_kv = triton_kv.write_kv
        self._decode = triton_attention.decode_attention

    def write_kv(self, k_cache, v_cache, k, v, slots) -> None:
        self._write_kv(k_cache, v_cache, k, v, slots, **_scales(k_cache, v_cache))

    def prepare_decode(self, page_table, seq_lens, page_size: int):
        return None  # the kernel reads the pages itself, and can be captured in a CUDA graph

    def decode_attention(self, q, k_cache, v_cache, page_table, seq_lens, scale, prepared=None) -> torch.Tensor:
        if prepared is not None:
            return reference.decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale, prepared)
        return self._decode(q, k_cache, v_cache, page_table, seq_lens, scale, **_scales(k_cache, v_cache))
