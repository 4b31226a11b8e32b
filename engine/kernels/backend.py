"""Which kernel implementation a process uses: the decision, kept apart from the dispatch.

`select_attention_backend(device)` returns "triton", "cpu" or "torch"; engine/kernels/
attention.py calls it once (in set_backend) and binds that implementation's functions (the
linear and element-wise dispatch points, engine/kernels/linear.py and fused.py, follow it).
"cpu" is our C++ extension (engine/kernels/cpu_ext.py: AVX-512 VNNI/BF16 kernels for
attention over the pages, the matrix multiplies and the element-wise work).

PREHEAT_ATTENTION_BACKEND=torch|triton|cpu overrides the choice. It exists so one machine
can run the same model on two paths and compare them (benchmarks/gpu_check.py and
benchmarks/decode_step.py do), and so an operator can step around a misbehaving kernel
without a rebuild: `torch` runs the PyTorch reference for everything.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

ENV_OVERRIDE = "PREHEAT_ATTENTION_BACKEND"
BACKENDS = ("torch", "triton", "cpu")


def choose_backend(
    device_type: str, triton_importable: bool, override: str | None, interpreting: bool,
    env_name: str = ENV_OVERRIDE, cpu_kernels: Callable[[], str | None] | None = None,
) -> tuple[str, str]:
    """(backend, why). Pure but for `cpu_kernels`: every other input is passed in, so every
    branch is testable on CPU. `env_name` names the override in messages (the MoE experts use
    the same decision). `cpu_kernels`, when the caller has CPU kernels at all, is asked only
    when they are an option: it returns None when they can run here, else why not (building
    them is costly, so a GPU process never pays for it)."""
    choices = BACKENDS if cpu_kernels is not None else tuple(b for b in BACKENDS if b != "cpu")
    if override:
        if override not in choices:
            raise ValueError(f"{env_name}={override!r}: expected one of {', '.join(choices)}")
        if override == "triton":
            if not triton_importable:
                raise ValueError(f"{env_name}=triton but Triton is not installed")
            if device_type != "cuda" and not interpreting:
                raise ValueError(
                    f"{env_name}=triton on {device_type} needs TRITON_INTERPRET=1 (slow; tests only)"
                )
        if override == "cpu":
            if device_type != "cpu":
                raise ValueError(f"{env_name}=cpu on a {device_type} device")
            if cpu_kernels is not None and (why_not := cpu_kernels()) is not None:
                raise ValueError(f"{env_name}=cpu but the CPU kernels are unavailable: {why_not}")
        return override, f"{env_name}={override}"
    if device_type == "cpu" and cpu_kernels is not None:
        why_not = cpu_kernels()
        if why_not is None:
            return "cpu", "CPU with AVX-512 VNNI/BF16 kernels"
        return "torch", f"device is cpu; CPU kernels unavailable: {why_not}"
    if device_type != "cuda":
        return "torch", f"device is {device_type}"
    if not triton_importable:
        return "torch", "Triton is not installed"
    return "triton", "CUDA device with Triton"


def _cpu_kernels_unavailable() -> str | None:
    from preheat.engine.kernels import cpu_ext

    return None if cpu_ext.load() is not None else cpu_ext.unavailable_reason


def select_attention_backend(device: torch.device | str) -> str:
    """'triton' on CUDA when Triton is importable, 'cpu' on a CPU that runs our kernels,
    else 'torch'; logs the choice and why."""
    name, why = choose_backend(
        torch.device(device).type,
        importlib.util.find_spec("triton") is not None,
        os.environ.get(ENV_OVERRIDE) or None,
        os.environ.get("TRITON_INTERPRET") == "1",
        cpu_kernels=_cpu_kernels_unavailable,
    )
    log.info("attention backend: %s (%s)", name, why)
    return name
