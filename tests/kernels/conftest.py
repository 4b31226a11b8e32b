"""Kernel tests run the Triton kernels compiled on CUDA, or under the Triton interpreter on CPU.

TRITON_INTERPRET must be set before `@triton.jit` runs, i.e. before the kernel modules are
first imported; pytest imports this conftest before any test module in this folder.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
