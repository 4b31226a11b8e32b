"""Which attention implementation a process uses: the decision, kept apart from the dispatch.

`select_attention_backend(device)` returns "triton" or "torch"; engine/kernels/attention.py
calls it once (in set_backend) and binds that implementation's functions.

PREHEAT_ATTENTION_BACKEND=torch|triton overrides the choice. It exists so one GPU machine
can run the same model on both paths and compare them (benchmarks/gpu_check.py does), and so
an operator can step around a misbehaving kernel without a rebuild.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

log = logging.getLogger(__name__)

ENV_OVERRIDE = "PREHEAT_ATTENTION_BACKEND"
BACKENDS = ("torch", "triton")


def choose_backend(
    device_type: str, triton_importable: bool, override: str | None, interpreting: bool,
    env_name: str = ENV_OVERRIDE,
) -> tuple[str, str]:
    """(backend, why). Pure: every input is passed in, so every branch is testable on CPU.
    `env_name` names the override in messages (the MoE experts use the same decision)."""
    if override:
        if override not in BACKENDS:
            raise ValueError(f"{env_name}={override!r}: expected one of {', '.join(BACKENDS)}")
        if override == "triton":
            if not triton_importable:
                raise ValueError(f"{env_name}=triton but Triton is not installed")
            if device_type != "cuda" and not interpreting:
                raise ValueError(
                    f"{env_name}=triton on {device_type} needs TRITON_INTERPRET=1 (slow; tests only)"
                )
        return override, f"{env_name}={override}"
    if device_type != "cuda":
        return "torch", f"device is {device_type}"
    if not triton_importable:
        return "torch", "Triton is not installed"
    return "triton", "CUDA device with Triton"


def select_attention_backend(device: torch.device | str) -> str:
    """'triton' on CUDA when Triton is importable, else 'torch'; logs the choice and why."""
    name, why = choose_backend(
        torch.device(device).type,
        importlib.util.find_spec("triton") is not None,
        os.environ.get(ENV_OVERRIDE) or None,
        os.environ.get("TRITON_INTERPRET") == "1",
    )
    log.info("attention backend: %s (%s)", name, why)
    return name
