"""The kernel backend: what the model asks of its kernels (the `KernelBackend` contract),
which implementation a process uses, and the object that carries the choice.

`select_backend(device)` decides once (the engine calls it before it builds the model: the
linear weights' form depends on it) and returns one object; the model's parts keep it from
build time and call nothing else (no module-level state: two engines in one process may run
two backends). Three implementations:

- `TorchBackend` (engine/kernels/torch_backend.py): the PyTorch reference for everything;
- `CpuKernelBackend` (engine/kernels/cpu_backend.py): our C++ extension
  (engine/kernels/cpu_ext.py: AVX-512 VNNI/BF16 or AVX2 kernels for attention over the pages, the
  matrix multiplies and the element-wise work);
- `TritonBackend` (engine/kernels/triton_backend.py): Triton KV write and decode attention.

`select_attention_backend(device)` returns the name ("triton", "cpu" or "torch");
`choose_backend` is the pure decision under it.
PREHEAT_ATTENTION_BACKEND=torch|triton|cpu overrides the choice. It exists so one machine
can run the same model on two paths and compare them (benchmarks/gpu_check.py and
benchmarks/decode_step.py do), and so an operator can step around a misbehaving kernel
without a rebuild: `torch` runs the PyTorch reference for everything.

Imports: engine/kernels imports nothing else of the engine (tests/engine/test_import_rules.py, from the folder READMEs).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from preheat.engine.kernels.cpu_backend import CpuKernelBackend
from preheat.engine.kernels.fused import RopeInputs
from preheat.engine.kernels.int8 import QuantizedWeight
from preheat.engine.kernels.linear import LinearWeight
from preheat.engine.kernels.torch_backend import TorchBackend
from preheat.engine.kernels.triton_backend import TritonBackend

__all__ = [
    "BACKENDS", "ENV_OVERRIDE", "CpuKernelBackend", "KernelBackend", "TorchBackend", "TritonBackend",
    "choose_backend", "make_backend", "select_attention_backend", "select_backend",
]

log = logging.getLogger(__name__)

ENV_OVERRIDE = "PREHEAT_ATTENTION_BACKEND"
BACKENDS = ("torch", "triton", "cpu")


@runtime_checkable
class KernelBackend(Protocol):
    """What the model's layers call, with the shapes (docs/engine-internals.md keeps the same
    text). A cache is [num_pages, page_size, kvh, hd] (a KVPool layer's view) and a token's
    slot is `page * page_size + offset`. Implementations may hold state (a kernels module),
    never per-step state: the `prepare_*` results carry that from one layer to the next."""

    name: str  # "torch", "triton" or "cpu": logs, the runner's CUDA-graph decision, benchmarks
    pad_cpu_rows: bool  # CPU matmuls run at bucketed row counts (oneDNN builds one per shape)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor) -> None:  # fmt: skip
        """Stores k, v [T, kvh, hd] at `slots` (int64 [T]); an fp8 cache is quantized with
        its scales (engine/kernels/kv_fp8.py)."""

    def prepare_decode(self, page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> Any:
        """Per-step work every layer's decode attention shares (or None): called once per
        forward pass, its result handed to each layer's `decode_attention`."""

    def prepare_extend(self, page_table: torch.Tensor, prefix_lens: list[int], extend_lens: list[int],
                       page_size: int) -> Any:  # fmt: skip
        """Per-step work every layer's extend attention shares (or None), as prepare_decode:
        a batched plan (engine/kernels/batched_extend.py), decode rows for a short extend
        (CPU), or None (the per-sequence reference runs)."""

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         prepared: Any = None) -> torch.Tensor:  # fmt: skip
        """q [B, num_heads, hd] -> [B, num_heads, hd]. page_table int32 [B, max_pages]
        (unused entries 0); seq_lens int32 [B], tokens in the cache *including* the one just
        written. GQA when num_heads > kvh: head h reads KV head h // (num_heads // kvh)."""

    def extend_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, prefix_lens: list[int], extend_lens: list[int], scale: float,
                         prepared: Any = None) -> torch.Tensor:  # fmt: skip
        """q [sum(extend_lens), num_heads, hd]: the new tokens of each sequence back to back,
        their K/V already written; sequence i attends causally to its prefix_lens[i] cached
        tokens plus its own new ones. Returns [sum(extend_lens), num_heads, hd]."""

    def prepare_linear(self, weight: torch.Tensor | QuantizedWeight | LinearWeight, bias: torch.Tensor | None,
                       dtype: torch.dtype) -> LinearWeight:  # fmt: skip
        """Once at load: weight [N, K] (a tensor or int8) in the form `apply_linear` reads;
        `dtype` is the activations'. LinearWeight.kind: "dense" (F.linear), "bf16" / "f32" / "int8"
        (packed for the CPU kernels) or "int8-reference" (PyTorch emulation of the kernel).
        A LinearWeight (already prepared, e.g. read back by engine/model/prepared_cache.py)
        is returned as it is."""

    def apply_linear(self, x: torch.Tensor, w: LinearWeight, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> x W^T (+ bias) (+ residual), in x's dtype; the residual is added after
        the product is rounded to that dtype."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """transformers' RMSNorm over x's last dimension: float32, cast back, then scaled by
        `weight` (which broadcasts: [hd] or [heads, hd])."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[M, 2I] = [gate | up] -> silu(gate) * up [M, I]."""

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, N] -> [M] int64: each row's argmax as torch.argmax(x, -1) picks it (the first
        of equal values; NaN counts largest). Greedy sampling's choice, every step."""

    def rope_inputs(self, rope: Any, positions: torch.Tensor, head_dim: int) -> RopeInputs:
        """Once per forward pass: what every layer's `rope_write_kv` needs for these rows
        (int64 positions [T]) from the model's RotaryEmbedding (engine/kernels/rope.py)."""

    def rope_write_kv(self, qkv: torch.Tensor, rows: int, rope: RopeInputs, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                      head_dim: int, qk: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Rotates q and k of the fused projection qkv [T, (H + 2 KVH) hd] (or `qk`
        [T, H + KVH, hd], e.g. after Qwen3's q/k norm), writes k and v of the first `rows`
        rows at `slots`; returns q [rows, H, hd]."""


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
            return "cpu", "the CPU runs Preheat's CPU kernels"
        return "torch", f"device is cpu; CPU kernels unavailable: {why_not}"
    if device_type != "cuda":
        return "torch", f"device is {device_type}"
    if not triton_importable:
        return "torch", "Triton is not installed"
    return "triton", "CUDA device with Triton"


def _cpu_kernels_unavailable() -> str | None:
    from preheat.engine.kernels import cpu_ext

    return None if cpu_ext.load() is not None else cpu_ext.unavailable_reason


def select_backend(device: torch.device | str, int8_activation_bits: int = 16) -> KernelBackend:
    """The backend object for a process on `device`: decided once (select_attention_backend,
    logged), then handed to whatever builds a model. `int8_activation_bits`: the CPU
    kernels' int8 activation width (--int8-activation-bits)."""
    return make_backend(select_attention_backend(device), int8_activation_bits)


def make_backend(name: str, int8_activation_bits: int = 16) -> KernelBackend:
    """The object of a chosen backend name. A Triton or CPU build that turns out unusable
    after all falls back to the PyTorch backend with a log line: it must not stop serving."""
    if name == "cpu":
        from preheat.engine.kernels import cpu_ext

        module = cpu_ext.load()
        if module is not None:
            return CpuKernelBackend(module, int8_activation_bits=int8_activation_bits)
        log.warning("CPU kernels unavailable (%s); using PyTorch kernels", cpu_ext.unavailable_reason)
    if name == "triton":
        try:
            return TritonBackend()
        except Exception as exc:  # a missing or broken Triton must not stop serving
            log.warning("Triton kernels unavailable (%s); using PyTorch attention", exc)
    return TorchBackend()


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
