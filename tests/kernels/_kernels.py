"""Imports the Triton kernel modules in the mode this machine can run (see conftest.py).

If something imported them before TRITON_INTERPRET was set (so their kernels were compiled
for a GPU that is not there), reload them: a test must exercise the kernels, not fail on the
import order.
"""

from __future__ import annotations

import importlib

import torch

from preheat.engine.kernels import triton_attention, triton_kv, triton_moe

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

if DEVICE.type == "cpu":
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton_kv._write_kv_kernel, InterpretedFunction):
        triton_kv = importlib.reload(triton_kv)
        triton_attention = importlib.reload(triton_attention)
    if not isinstance(triton_moe._grouped_gemm_kernel, InterpretedFunction):
        triton_moe = importlib.reload(triton_moe)
    assert isinstance(triton_attention._decode_stage1, InterpretedFunction)
    assert isinstance(triton_moe._grouped_gemm_kernel, InterpretedFunction)

__all__ = ["DEVICE", "triton_attention", "triton_kv", "triton_moe"]
