"""The CPU kernels' matrices in one memory mapping backed by 2 MiB pages.

A decode step streams every matrix once, and on the CPU a matrix lies in 4 KiB pages of
its own allocation: each 4 KiB of weights costs the core a TLB miss and a page walk while
the kernel streams it, ~25,000 of them a step for the embedded model's 98 MB. Here every
packed matrix (the CPU kernels' kinds: codes, block scales, biases) goes into one anonymous
mapping advised MADV_HUGEPAGE, so the kernel backs it with transparent huge pages: 2 MiB a
TLB entry, ~50 for the same model. Measured (benchmarks/results/weight_huge_pages.md: same
process, the two placements alternating): SmolLM2's 4-bit GGUF decode steps 0.85-0.95x the
time at batch 1 and 0.95-0.96x at 8 over three runs on the Intel Xeon host; bf16 0.97-1.01x.

Never on the way to /ready: done synchronously at load, the first touch of the new memory
(0.3-0.36 s for the embedded model on this project's VM, whose hypervisor backs guest
memory on first touch) took restarts with templates + snapshot from 3.46 s to 4.35 s to
ready, past issue 27's 4 s. So the engine starts `WeightMove` once it serves
(`Engine.weight_move.start()`: after /ready, or at the end of LLM(...)): a thread at idle
priority copies the matrices into an arena while the engine serves from the old ones, and
the stepping thread swaps them in at the start of a step (`apply_if_done`: the weights'
attributes and the decode stack's native object, which holds raw pointers), then the old
tensors are freed. Memory peaks at the weights twice until then, so a move that would take
more than half the memory left is not made. Nothing moves with PREHEAT_HUGE_PAGES=0, where
the machine gives no huge pages (THP `never`, not Linux), on a GPU or on tensor-parallel
ranks; the kernels read the same bytes either way, so outputs are identical. The KV pool stays in 4 KiB
pages (kv/pool.py: a first touch of a 2 MiB page inside a prefill would zero all of it).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from preheat.engine.idle_priority import lower_this_thread, start_thread
from preheat.engine.kernels.linear import PACKED_TENSORS, LinearWeight
from preheat.engine.model import decode_stack

log = logging.getLogger(__name__)

ENV_SWITCH = "PREHEAT_HUGE_PAGES"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor's start: a cache line (the kernels' loads want no more)
MOVED = (*{name for names in PACKED_TENSORS.values() for name in names}, "bias")


class Arena:
    """One anonymous mapping advised MADV_HUGEPAGE, 2 MiB aligned, that tensors are copied
    into back to back (`place`). The views it hands out hold the mapping (their storage)
    and this object (an attribute, which `holder` reads)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(self.buffer, dtype=torch.uint8)
        self.skip = -raw.data_ptr() % HUGE_PAGE  # the first tensor at a 2 MiB boundary
        self.buffer.madvise(mmap.MADV_HUGEPAGE, self.skip, max(1, nbytes))  # OSError: the caller's
        self.base = raw.data_ptr() + self.skip
        self._raw = raw
        self.used = 0
        self.tensors = 0

    @staticmethod
    def slot(t_bytes: int) -> int:
        return (t_bytes + ALIGN - 1) // ALIGN * ALIGN

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` (contiguous, CPU) in the next slot."""
        nbytes = t.numel() * t.element_size()
        if self.used + nbytes > self.nbytes:
            raise ValueError(f"arena of {self.nbytes} bytes full ({self.used} used, {nbytes} asked)")
        start = self.skip + self.used
        view = self._raw[start : start + nbytes].view(t.dtype).view(t.shape)
        # One thread's memmove (the GIL released), not copy_: a copy on a background thread
        # must not fork a team of intra-op threads beside the engine's.
        ctypes.memmove(view.data_ptr(), t.contiguous().data_ptr(), nbytes)
        view.arena = self
        self.used += self.slot(nbytes)
        self.tensors += 1
        return view


def holder(t: torch.Tensor) -> Arena | None:
    """The arena that handed out this tensor (`place`), if any."""
    return getattr(t, "arena", None)


def open_arena(nbytes: int, environ: Mapping[str, str] = os.environ, setting: str | None = None) -> Arena | None:
    """An arena of `nbytes`, or None (logged) where huge pages are off (see `why_not`)."""
    reason = why_not(environ, setting)
    if reason is None:
        try:
            return Arena(nbytes)
        except OSError as exc:
            reason = f"madvise: {exc}"
    log.info("weights: kept in 4 KiB pages (%s)", reason)
    return None


def thp_setting(path: Path | None = None) -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise`, `never`), None if unknown."""
    try:
        text = (path or THP_SETTING).read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def why_not(environ: Mapping[str, str] = os.environ, setting: str | None = None) -> str | None:
    """Why the matrices stay where they are, or None when they move."""
    if environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "no MADV_HUGEPAGE on this system"
    setting = setting if setting is not None else thp_setting()
    if setting not in ("always", "madvise"):
        return f"transparent huge pages are {setting or 'unavailable'}"
    return None


Key = tuple[int, int, torch.dtype, tuple[int, ...]]  # a tensor's address, bytes, dtype, shape


def key(t: torch.Tensor) -> Key:
    return t.data_ptr(), t.numel() * t.element_size(), t.dtype, tuple(t.shape)


def movable(weights: Iterable[LinearWeight]) -> list[tuple[LinearWeight, str, Key]]:
    """(weight, attribute, tensor key) of every CPU tensor of the packed weights, each weight
    once (the key finds a tensor two weights share)."""
    out, seen = [], set()
    for w in weights:
        if id(w) in seen or w.kind not in PACKED_TENSORS:
            continue
        seen.add(id(w))
        for name in MOVED:
            t = getattr(w, name, None)
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() > 0 and t.is_contiguous():
                out.append((w, name, key(t)))
    return out


Assignment = tuple[LinearWeight, str, torch.Tensor]  # weight, attribute, its copy in the arena


def copies(weights: Iterable[LinearWeight], environ: Mapping[str, str] = os.environ, setting: str | None = None,
           headroom: int | None = None, stop: threading.Event | None = None,
           ) -> tuple[Arena, list[Assignment]] | None:  # fmt: skip
    """Copies of the packed weights' tensors in a new arena, the weights untouched (any
    thread: it only reads them). A tensor two weights share gets one copy; tensors already
    in an arena are left out. None (logged) when there is nothing to copy, huge pages are
    off, the arena would take more than half of `headroom` bytes, or `stop` was set (looked
    at between tensors: the process is exiting, see engine/idle_priority.py)."""
    plan = [(w, name, k) for w, name, k in movable(weights) if holder(getattr(w, name)) is None]
    if not plan:
        return None
    size = sum(Arena.slot(k[1]) for k in {k for _w, _name, k in plan})
    if headroom is not None and 2 * size > headroom:
        log.info("weights: kept in 4 KiB pages (moving %.0f MiB would take more than half of the %.0f MiB left)",
                 size / 2**20, headroom / 2**20)  # fmt: skip
        return None
    arena = open_arena(size, environ, setting)
    if arena is None:
        return None
    made: dict[Key, torch.Tensor] = {}
    out = []
    for w, name, k in plan:
        if stop is not None and stop.is_set():
            return None
        if k not in made:
            made[k] = arena.place(getattr(w, name))
        out.append((w, name, made[k]))
    return arena, out


def apply(assignments: list[Assignment]) -> None:
    """Points the weights at their copies (the stepping thread, between steps)."""
    for w, name, copy in assignments:
        setattr(w, name, copy)


class WeightMove:
    """A model's matrices copied into an arena by a background thread at idle priority
    (`start`, once the engine serves), swapped in by the stepping thread (`apply_if_done`
    at a step's start). `headroom` tells the memory left when the copy begins."""

    def __init__(self, model: Any, headroom: Callable[[], int | None] = lambda: None,
                 environ: Mapping[str, str] = os.environ) -> None:  # fmt: skip
        self.model, self.headroom, self.environ = model, headroom, environ
        self.moving = False  # a copy thread was started
        self.applied = False
        self._made: tuple[Arena, list[Assignment]] | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Starts the copy (once; nothing when huge pages are off or nothing is packed)."""
        with self._lock:
            if self.moving or self._done.is_set():
                return
            if why_not(self.environ) is not None or not movable(self.model.matrices()):
                self._done.set()
                return
            self.moving = True
            start_thread(self._run, "weight-move")

    def _run(self, stop: threading.Event) -> None:
        try:
            lower_this_thread("weight-move", "copying")
            started = time.monotonic()
            self._made = copies(self.model.matrices(), self.environ, headroom=self.headroom(), stop=stop)
            if self._made is not None:
                arena = self._made[0]
                log.info("weights: %d tensors, %.0f MiB, copied into huge pages in %.2fs (in use from the next step)",
                         arena.tensors, arena.used / 2**20, time.monotonic() - started)  # fmt: skip
        except Exception:  # a failed move costs only its speed-up
            log.exception("weights: moving them into huge pages failed; they stay where they are")
            self._made = None
        finally:
            self._done.set()

    def finish(self, timeout: float | None = None) -> bool:
        """Starts the move, waits for the copy and swaps it in, for a caller that steps the
        engine itself and wants the weights where a server has them once it has served a
        while (benchmarks: engines built side by side in one process otherwise read their
        matrices from 4 KiB pages placed by allocation order, which measured 3-4% apart
        between two identical engines). On the stepping thread, between steps. True when
        the weights are in huge pages now."""
        self.start()
        if not self.wait(timeout):
            return False
        self.apply_if_done()
        return self.applied

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the move is done with copying (made, given up, or nothing to move)."""
        return self._done.wait(timeout)

    @property
    def finished(self) -> bool:
        """Done with: applied, or nothing to apply."""
        return self._done.is_set() and (self.applied or self._made is None)

    def apply_if_done(self) -> bool:
        """On the stepping thread: swaps the copies in once they are made (the weights'
        attributes, the model's arena, a new native decode stack over the new tensors: it
        holds raw pointers). True when it did, now."""
        if self.applied or not self._done.is_set() or self._made is None:
            return False
        arena, assignments = self._made
        apply(assignments)
        self.model.weight_arena = arena
        stack = self.model.decode_stack
        if stack is not None:
            rebuilt = decode_stack.build(self.model)
            if rebuilt is None:
                self.model.decode_stack = None
            else:
                stack.native = rebuilt.native
        self._made = (arena, [])  # the old tensors go with the last references to them
        self.applied = True
        return True
