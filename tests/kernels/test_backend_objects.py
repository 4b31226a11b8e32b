"""The kernel backend is one object, chosen once and handed to the model: each name gives its
implementation of the KernelBackend contract, a broken Triton falls back to PyTorch, the
Triton and CPU backends compute what the PyTorch one does through the same methods, and two
backends live side by side in one process (nothing module-wide is switched)."""

from __future__ import annotations

import logging

import pytest
import torch
from _kernels import DEVICE  # also loads the Triton modules in the mode this machine runs

from preheat.engine.kernels import backend, cpu_ext
from preheat.engine.kernels.backend import (
    CpuKernelBackend,
    KernelBackend,
    TorchBackend,
    TritonBackend,
    make_backend,
    select_backend,
)
from preheat.engine.kernels.rope import RotaryEmbedding
from preheat.engine.model.layers import DenseMLP

HAS_CPU_KERNELS = bool(cpu_ext.runnable_isas(cpu_ext.read_cpu_flags()))
needs_cpu_kernels = pytest.mark.skipif(not HAS_CPU_KERNELS, reason="this CPU runs neither build of the kernels")


def paged(gen: torch.Generator, lens: list[int], page_size: int, kvh: int, hd: int):
    """Caches with every sequence's tokens written through `write` later, and their table."""
    pages_each = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_each) + 2
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # page 0: scratch
    table = torch.zeros((len(lens), max(pages_each)), dtype=torch.int32)
    for i, n in enumerate(pages_each):
        table[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    shape = (num_pages, page_size, kvh, hd)
    return torch.zeros(shape), torch.zeros(shape), table


def slots_of(table: torch.Tensor, lens: list[int], page_size: int) -> torch.Tensor:
    return torch.tensor([int(table[i, p // page_size]) * page_size + p % page_size
                         for i, n in enumerate(lens) for p in range(n)])  # fmt: skip


def test_each_name_gives_its_implementation_of_the_contract():
    kinds = {"torch": TorchBackend, "triton": TritonBackend}
    if HAS_CPU_KERNELS:
        kinds["cpu"] = CpuKernelBackend
    for name, cls in kinds.items():
        made = make_backend(name)
        assert type(made) is cls and made.name == name
        assert isinstance(made, KernelBackend)


def test_a_broken_triton_falls_back_to_pytorch_with_a_log_line(monkeypatch, caplog):
    def broken(self):
        raise RuntimeError("no driver")

    monkeypatch.setattr(TritonBackend, "__init__", broken)
    with caplog.at_level(logging.WARNING, logger=backend.__name__):
        made = make_backend("triton")
    assert type(made) is TorchBackend
    assert "Triton kernels unavailable (no driver); using PyTorch attention" in caplog.text


def test_the_override_picks_the_object(monkeypatch):
    monkeypatch.setenv("PREHEAT_ATTENTION_BACKEND", "torch")
    assert type(select_backend("cpu")) is TorchBackend


def run_layer_attention(kernels: KernelBackend, lens: list[int], hd: int = 32, heads=(4, 2), page_size: int = 4):
    """One layer's rotary + KV write + decode attention of the last token of each sequence,
    through the backend's methods as the model calls them."""
    num_heads, kvh = heads
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, table = paged(gen, lens, page_size, kvh, hd)
    rope = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)), 1.0, torch.float32)
    positions = torch.cat([torch.arange(n) for n in lens])
    qkv = torch.randn((len(positions), (num_heads + 2 * kvh) * hd), generator=gen)
    slots = slots_of(table, lens, page_size)
    dev = DEVICE if isinstance(kernels, TritonBackend) else torch.device("cpu")
    k_cache, v_cache, table, qkv, slots, positions = (t.to(dev) for t in (k_cache, v_cache, table, qkv, slots,
                                                                          positions))  # fmt: skip
    rope.inv_freq = rope.inv_freq.to(dev)
    q = kernels.rope_write_kv(qkv, len(positions), kernels.rope_inputs(rope, positions, hd), k_cache, v_cache,
                              slots, num_heads, kvh, hd)  # fmt: skip
    last = torch.tensor(lens).cumsum(0) - 1
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    prepared = kernels.prepare_decode(table, seq_lens, page_size)
    out = kernels.decode_attention(q[last.to(dev)], k_cache, v_cache, table, seq_lens, hd**-0.5, prepared)
    return out.cpu(), k_cache.cpu()


def test_the_triton_backend_computes_what_the_pytorch_one_does():
    want, want_k = run_layer_attention(TorchBackend(), [5, 1, 13])
    got, got_k = run_layer_attention(TritonBackend(), [5, 1, 13])
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)  # a store is a copy
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_cpu_kernels
def test_the_cpu_backend_computes_what_the_pytorch_one_does():
    want, want_k = run_layer_attention(TorchBackend(), [5, 1, 13])
    got, got_k = run_layer_attention(make_backend("cpu"), [5, 1, 13])
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_cpu_kernels
def test_two_backends_in_one_process_keep_their_own_weights_and_kernels():
    gen = torch.Generator().manual_seed(3)
    gate_up, down = torch.randn((64, 32), generator=gen).bfloat16(), torch.randn((32, 32), generator=gen).bfloat16()
    on_cpu = DenseMLP(gate_up, down, backend=make_backend("cpu"))
    on_torch = DenseMLP(gate_up, down, backend=TorchBackend())  # built after: must not switch the first
    assert (on_cpu.down.kind, on_torch.down.kind) == ("bf16", "dense")
    x = torch.randn((3, 32), generator=gen).bfloat16()
    torch.testing.assert_close(on_cpu.forward(x).float(), on_torch.forward(x).float(), rtol=2e-2, atol=5e-2)
