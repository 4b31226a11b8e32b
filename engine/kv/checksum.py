"""The checksum of a KV tensor, shared by the L3 page files and the snapshot manifests so
both check the bytes they read back the same way."""

from __future__ import annotations

import hashlib

import torch


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's raw bytes (any dtype, fp8 included: hashed as uint8)."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
