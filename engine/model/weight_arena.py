"""The CPU kernels' matrices in one memory mapping backed by 2 MiB pages.

A decode step streams every matrix once, and on the CPU a matrix lies in 4 KiB pages of
its own allocation: each 4 KiB of weights costs the core a TLB miss and a page walk while
the kernel streams it, ~25,000 of them a step for the embedded model's 98 MB. `gather`
moves every packed matrix (the CPU kernels' kinds: codes, block scales, biases) into one
anonymous mapping advised MADV_HUGEPAGE, so the kernel backs it with transparent huge
pages: 2 MiB a TLB entry, ~50 for the same model. Measured (benchmarks/results/
weight_huge_pages.md: same process, the two placements alternating): SmolLM2's 4-bit GGUF
decode steps 0.93-0.95x the time at batch 1 and 8 on the Intel Xeon host.

Off by default, on with PREHEAT_HUGE_PAGES=1, because of what it costs at start: the
matrices' memory is touched as 2 MiB pages, once — a restart reads the prepared cache
straight into the arena (prepared_cache.read), a first start packs them and then moves them
here, each old tensor freed as it moves — plus up to 2 MiB of padding. On this project's
VM, whose hypervisor backs guest memory on first touch, that was 0.3-0.36 s more load for
the embedded model (94 MiB), and restarts with templates + snapshot went from a median of
3.46 s to 4.35 s to ready (benchmarks/cold_start.py), past issue 27's 4 s; with memory
already backed it is ~13 ms to zero and 9 ms to copy. A long-running server on a machine
whose memory is backed (bare metal, most cloud VMs) is where to turn it on. Nothing moves
where the machine gives no huge pages (THP `never`, not Linux); the kernels read the same
bytes either way, so outputs are identical. The KV pool stays in 4 KiB pages (kv/pool.py:
a first touch of a 2 MiB page inside a prefill would zero all of it).
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from preheat.engine.kernels.linear import PACKED_TENSORS, LinearWeight

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
        view.copy_(t)
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
    if environ.get(ENV_SWITCH, "0") != "1":
        return f"{ENV_SWITCH} is not 1"
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
    once. Keys, not tensors: `gather` frees each old tensor as it moves."""
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


def gather(weights: Iterable[LinearWeight], environ: Mapping[str, str] = os.environ,
           setting: str | None = None) -> Arena | None:  # fmt: skip
    """Moves the packed weights' tensors into one huge-page arena, in place: afterwards each
    weight's attributes are views of it (a tensor two weights share stays shared). Tensors
    already in an arena (prepared_cache.read places them as it reads) stay. The arena the
    weights are in, or None (logged) when they stay in 4 KiB pages."""
    weights = list(weights)
    plan = [(w, name, k) for w, name, k in movable(weights) if holder(getattr(w, name)) is None]
    if not plan:
        held = {
            id(a): a
            for w in weights
            for name in MOVED
            if isinstance(t := getattr(w, name, None), torch.Tensor) and (a := holder(t)) is not None
        }
        return next(iter(held.values())) if len(held) == 1 else None
    size = sum(Arena.slot(k[1]) for k in {k for _w, _name, k in plan})
    started = time.monotonic()
    arena = open_arena(size, environ, setting)
    if arena is None:
        return None
    # Old tensors are dropped as they move (no new CPU storage is made meanwhile, so a key's
    # address still names the tensor it was taken from).
    views: dict[Key, torch.Tensor] = {}
    for w, name, k in plan:
        if k not in views:
            views[k] = arena.place(getattr(w, name))
        setattr(w, name, views[k])
    log.info("weights: %d tensors, %.0f MiB, in huge pages (moved in %.2fs)", len(views), size / 2**20,
             time.monotonic() - started)  # fmt: skip
    return arena
