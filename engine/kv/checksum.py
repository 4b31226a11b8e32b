"""The checksum of a KV tensor, shared by the L3 page files and the snapshot manifests so
both check the bytes they read back the same way."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's raw bytes (any dtype, fp8 included: hashed as uint8). The bytes
    are hashed where they lie (no copy), and hashlib releases the GIL while it hashes them."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).reshape(-1).numpy()).hexdigest()


def tensors_sha256(tensors: Sequence[torch.Tensor]) -> list[str]:
    """`tensor_sha256` of each, hashed on every core: a restored snapshot checks hundreds of
    MB of KV before /ready, and on one core that was most of the restore step."""
    workers = min(len(tensors), os.cpu_count() or 1)
    if workers <= 1:
        return [tensor_sha256(t) for t in tensors]
    with ThreadPoolExecutor(workers, thread_name_prefix="kv-sha256") as pool:
        return list(pool.map(tensor_sha256, tensors))
