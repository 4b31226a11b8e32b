"""Dtype names: the one table that maps the names in flags and snapshot manifests to torch.

The names are torch's own attribute names, so `torch_dtype(name)` is `getattr(torch, name)`.
This module imports torch only when a name is resolved: engine/config.py reads the names to
build `preheat serve --help` before torch is loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Weight and activation dtypes (`--dtype`, besides "auto").
MODEL_DTYPES = ("float32", "bfloat16", "float16")
# What a KV page may be stored as: a model dtype, or fp8 with --kv-cache-dtype fp8 / fp8_e5m2.
KV_DTYPES = (*MODEL_DTYPES, "float8_e4m3fn", "float8_e5m2")
# The dtype codes safetensors writes in a file's header, per KV dtype.
SAFETENSORS_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
                     "float8_e5m2": "F8_E5M2"}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a name in KV_DTYPES; KeyError for any other name."""
    if name not in KV_DTYPES:
        raise KeyError(name)
    import torch

    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a dtype in KV_DTYPES; ValueError for any other dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in KV_DTYPES:
        raise ValueError(f"unsupported KV dtype for snapshots: {dtype}")
    return name
