"""CUDA-graph decode: capture one graph per batch size in a ladder, pad, replay.

A decode step launches hundreds of small kernels; at small batch the GPU waits on Python and
the launch queue. Replaying a captured graph launches them all at once. Graphs are captured
at start-up (before /ready: capture is part of the cold start Preheat moves out of the way).

Interface for engine/runner.py
------------------------------
    runner = CudaGraphRunner(
        decode_fn,                      # Callable[[DecodeInputs], Tensor]
        max_bs=cfg.cuda_graph_max_bs,   # largest captured batch
        max_pages=ceil(max_model_len / page_size),   # page-table width of the static buffer
        device=device,
        disable=cfg.disable_cuda_graph,
        eager_because=None,             # or a reason of the caller's: "attention backend is torch"
        on_capture=lambda seconds, sizes: metric.set(seconds),  # optional
    )
    runner.capture()                    # once, at start-up; returns seconds (0.0 when eager)
    logits = runner.run(DecodeInputs(input_ids, positions, slots, page_table, seq_lens))

`decode_fn(inputs)` is the model's whole decode forward (embedding -> write_kv -> attention
-> logits) for `inputs.batch_size` sequences, one new token each:
    input_ids  int64 [bs]              the token to feed
    positions  int64 [bs]              its position (rope)
    slots      int64 [bs]              where its K/V goes in the pool (page * page_size + offset)
    page_table int32 [bs, max_pages]   the sequence's pages, unused entries 0
    seq_lens   int32 [bs]              tokens in cache including this one
and returns a tensor whose first dimension is bs (logits [bs, vocab]). Sampling stays outside.
When graphs are used, decode_fn is called only during capture, on the static buffers; each
`run` copies the real rows into those buffers, fills the padding rows, and replays. Padding
rows are input_id 0, position 0, slot 0, page_table row of 0s, seq_len 1: they write into and
read from scratch page 0, which the KV pool reserves for exactly this.

What decode_fn must do to be capturable: no host syncs (no .item(), int(tensor), .tolist()),
no shapes that depend on tensor values, no CPU tensors created per call, and it must read
sequence lengths from `seq_lens` on the device (the Triton decode kernel does; the PyTorch
reference's `int(seq_lens.max())` does not, so graphs need the Triton backend). Whatever it
allocates comes from the shared graph pool and is reused on replay.

`run` returns a view of a static output buffer when it replays: consume it (sample) before the
next `run`, or clone it. Eager runs (no CUDA, --disable-cuda-graph, batch above max_bs) call
decode_fn on the caller's tensors directly; each reason is logged once.

Attributes for metrics (preheat_cuda_graph_capture_seconds is registered by the server):
    runner.batch_sizes      captured sizes, ascending ([] when eager)
    runner.capture_seconds  wall time of capture()
    runner.eager_reason     why graphs are off, or None
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

log = logging.getLogger(__name__)

LADDER_SMALL = (1, 2, 4, 8)
LADDER_STEP = 8
PAD_SLOT = 0  # page 0, offset 0: the pool's scratch page
PAD_SEQ_LEN = 1  # one (scratch) token: attention over it is well defined, never empty


@dataclass
class DecodeInputs:
    input_ids: torch.Tensor  # int64 [bs]
    positions: torch.Tensor  # int64 [bs]
    slots: torch.Tensor  # int64 [bs]
    page_table: torch.Tensor  # int32 [bs, n_pages]
    seq_lens: torch.Tensor  # int32 [bs]

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]


DecodeFn = Callable[[DecodeInputs], torch.Tensor]


# --- decisions (pure) ---------------------------------------------------------------------


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The ladder of batch sizes to capture, ascending: 1, 2, 4, 8, then every 8, then max_bs.

    Every 8 (as SGLang) bounds padding waste at 7 rows while keeping capture count and graph
    memory linear in max_bs; max_bs itself is always captured so the flag means what it says.
    """
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    sizes = [s for s in LADDER_SMALL if s <= max_bs]
    sizes += list(range(2 * LADDER_STEP, max_bs + 1, LADDER_STEP))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def padded_batch_size(bs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= bs, or None when bs is above them all (run eagerly)."""
    for size in sizes:  # ascending, a few dozen at most
        if size >= bs:
            return size
    return None


def graphs_off_reason(device: torch.device, disable: bool, cuda_available: bool) -> str | None:
    """Why decode must run eagerly on this process, or None when graphs can be captured."""
    if disable:
        return "--disable-cuda-graph is set"
    if torch.device(device).type != "cuda":
        return f"device is {torch.device(device).type}, not cuda"
    if not cuda_available:
        return "CUDA is not available"
    return None


# --- static buffers -----------------------------------------------------------------------


class StaticDecodeBuffers:
    """The input tensors every captured graph reads: allocated once at max_bs, never moved."""

    def __init__(self, max_bs: int, max_pages: int, device: torch.device | str) -> None:
        self.max_bs = max_bs
        self.max_pages = max_pages
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(max_bs, dtype=i64, device=device)
        self.positions = torch.zeros(max_bs, dtype=i64, device=device)
        self.slots = torch.full((max_bs,), PAD_SLOT, dtype=i64, device=device)
        self.page_table = torch.zeros(max_bs, max_pages, dtype=i32, device=device)
        self.seq_lens = torch.full((max_bs,), PAD_SEQ_LEN, dtype=i32, device=device)

    def view(self, bs: int) -> DecodeInputs:
        """The first bs rows, as the inputs a graph of size bs was captured on."""
        return DecodeInputs(
            self.input_ids[:bs],
            self.positions[:bs],
            self.slots[:bs],
            self.page_table[:bs],
            self.seq_lens[:bs],
        )

    def load(self, inputs: DecodeInputs, padded_bs: int) -> DecodeInputs:
        """Copies the real rows in, makes rows bs..padded_bs padding; returns view(padded_bs).

        Copies are in place (the graphs hold these addresses) and device-to-device.
        """
        bs = inputs.batch_size
        width = inputs.page_table.shape[1]
        if not bs <= padded_bs <= self.max_bs:
            raise ValueError(f"batch {bs} padded to {padded_bs} does not fit max_bs {self.max_bs}")
        if width > self.max_pages:
            raise ValueError(f"page table has {width} columns, buffers hold {self.max_pages}")
        self.input_ids[:bs].copy_(inputs.input_ids)
        self.positions[:bs].copy_(inputs.positions)
        self.slots[:bs].copy_(inputs.slots)
        self.seq_lens[:bs].copy_(inputs.seq_lens)
        # Columns past `width` may hold a previous, longer batch's pages: zero them (contract:
        # unused entries are 0) so no kernel ever sees a stale page id.
        self.page_table[:padded_bs].zero_()
        self.page_table[:bs, :width].copy_(inputs.page_table)
        self.input_ids[bs:padded_bs].zero_()
        self.positions[bs:padded_bs].zero_()
        self.slots[bs:padded_bs].fill_(PAD_SLOT)
        self.seq_lens[bs:padded_bs].fill_(PAD_SEQ_LEN)
        return self.view(padded_bs)


# --- graph capture ------------------------------------------------------------------------


class GraphBackend(Protocol):
    """Captures `fn` once; returns (replay, output). replay() re-runs the captured work,
    writing into the same `output` tensor. Injected so the bookkeeping is testable on CPU."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]: ...


class TorchCudaGraphBackend:
    """torch.cuda.CUDAGraph capture with one memory pool shared by every graph.

    Graphs are captured largest first, so the pool grows to the largest graph's need once
    and each smaller graph reuses that memory instead of adding its own.
    """

    WARMUP_RUNS = 2  # first run compiles Triton kernels / picks cuBLAS algos; keep them out

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=device)

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        # Warm up on a side stream, as PyTorch requires, so lazy initialisation is not captured.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(self.WARMUP_RUNS):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        return graph.replay, out


class CudaGraphRunner:
    """Runs decode steps through captured graphs when it can, eagerly when it cannot."""

    def __init__(
        self,
        decode_fn: DecodeFn,
        *,
        max_bs: int,
        max_pages: int,
        device: torch.device | str,
        disable: bool = False,
        eager_because: str | None = None,
        on_capture: Callable[[float, list[int]], None] | None = None,
        backend: GraphBackend | None = None,
    ) -> None:
        self.decode_fn = decode_fn
        self.device = torch.device(device)
        self.max_bs = max_bs
        self.max_pages = max_pages
        self.on_capture = on_capture
        self._backend = backend
        # An injected backend stands in for CUDA (tests); only the flag can turn it off.
        cuda_ok = backend is not None or torch.cuda.is_available()
        device_for_check = torch.device("cuda") if backend is not None else self.device
        # eager_because: a reason the caller knows of, e.g. an attention backend that syncs.
        self.eager_reason = eager_because or graphs_off_reason(device_for_check, disable, cuda_ok)
        self.batch_sizes: list[int] = []
        self.capture_seconds = 0.0
        self.buffers: StaticDecodeBuffers | None = None
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self._logged_above_max = False

    @property
    def enabled(self) -> bool:
        return self.eager_reason is None

    def capture(self) -> float:
        """Captures every ladder size, largest first. Returns (and meters) the seconds taken."""
        if not self.enabled:
            log.info("CUDA graphs off (%s): decoding eagerly", self.eager_reason)
            return 0.0
        sizes = capture_batch_sizes(self.max_bs)
        start = time.perf_counter()
        self.buffers = StaticDecodeBuffers(self.max_bs, self.max_pages, self.device)
        backend = self._backend or TorchCudaGraphBackend(self.device)
        # torch.cuda.graph() runs gc.collect() on entry, once per graph; freezing what exists
        # now makes those collections cheap (SGLang does the same to cut capture time).
        gc.collect()
        gc.freeze()
        try:
            for bs in reversed(sizes):
                static = self.buffers.view(bs)  # all padding rows: valid dummy inputs
                self._graphs[bs] = backend.capture(lambda static=static: self.decode_fn(static))
        finally:
            gc.unfreeze()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        self.batch_sizes = sizes
        log.info(
            "captured %d CUDA graphs (batch sizes %s) in %.2f s",
            len(sizes), ",".join(map(str, sizes)), self.capture_seconds,
        )
        if self.on_capture is not None:
            self.on_capture(self.capture_seconds, list(sizes))
        return self.capture_seconds

    def uses_graph(self, bs: int) -> bool:
        return bool(self._graphs) and padded_batch_size(bs, self.batch_sizes) is not None

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """One decode step; returns decode_fn's output for the real rows only."""
        bs = inputs.batch_size
        padded = padded_batch_size(bs, self.batch_sizes) if self._graphs else None
        if padded is None:
            if self._graphs and not self._logged_above_max:
                log.info(
                    "decode batch %d is above --cuda-graph-max-bs %d: running it eagerly",
                    bs, self.max_bs,
                )
                self._logged_above_max = True
            return self.decode_fn(inputs)
        assert self.buffers is not None
        self.buffers.load(inputs, padded)
        replay, out = self._graphs[padded]
        replay()
        return out[:bs]


__all__ = [
    "CudaGraphRunner",
    "DecodeInputs",
    "StaticDecodeBuffers",
    "TorchCudaGraphBackend",
    "capture_batch_sizes",
    "graphs_off_reason",
    "padded_batch_size",
]

