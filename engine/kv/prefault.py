"""Gives a CPU KV pool's first pages their memory while the engine has nothing else to do.

The pool is an anonymous mapping (pool.py `zeroed`): the kernel gives each 4 KiB page its
memory on first touch, so start-up writes none of it and never-used pages cost nothing. The
price comes later, inside the first prompts a replica serves: every page of K and V they
write faults, on the compute threads, in the RoPE + KV write (a fresh replica pays it on
every request until its pool has been used once: the radix cache keeps freed pages, so new
ones come from the untouched end of the free list, lowest ids first).

`Prefaulter` runs one thread at SCHED_IDLE priority — it gets a core only when nothing else
wants it (a replica between /ready and its first requests, a warm standby, gaps in load) —
that populates the pool's lowest pages, every plane, with MADV_POPULATE_WRITE, a slice at a
time, up to `budget_bytes`, then ends. Bounded, so a pool's memory does not all become
resident at start (a pool sized beyond what the container can hold would otherwise die at
start instead of under load). Where the call is missing (Linux before 5.14, other systems)
the thread ends at its first call and pages fault as before.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable

from preheat.engine.idle_priority import lower_this_thread, start_thread

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+); the mmap module of Python 3.11 lacks it
OS_PAGE = mmap.PAGESIZE  # madvise takes page-aligned starts (4 KiB on x86, up to 64 KiB on arm64)
SLICE_BYTES = 2 << 20  # per call, over all planes: about a millisecond of the kernel's work
DEFAULT_BUDGET_BYTES = 256 << 20


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn  # ctypes releases the GIL for the call


class Prefaulter:
    """Populates pages [1, stop) of every plane, lowest first, from a background thread.

    `planes` memory planes of `plane_pages` pages of `page_bytes` each, back to back from
    `base` (the pool tensor is [layers, 2, pages, ...]: one plane per layer's K or V);
    `stop` covers `budget_bytes` over all planes. `owner` bounds the mapping's life: the
    thread holds it only during a call and ends once it is gone."""

    def __init__(self, owner: object, base: int, planes: int, plane_pages: int, page_bytes: int,
                 budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:  # fmt: skip
        self._owner = weakref.ref(owner)
        self.base, self.planes, self.plane_pages, self.page_bytes = base, planes, plane_pages, page_bytes
        self.stop = min(plane_pages, 1 + max(1, budget_bytes // max(1, planes * page_bytes)))
        self.done = 1  # page 0 is the scratch page
        self.failed: str | None = None
        self._thread = start_thread(self._run, "kv-prefault")

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self, stop: threading.Event) -> None:
        madvise = _madvise()
        if madvise is None:
            self.failed = "no madvise"
            return
        lower_this_thread("kv-prefault", "populating")
        per_call = max(1, SLICE_BYTES // max(1, self.planes * self.page_bytes))
        while self.done < self.stop and not stop.is_set():  # set at exit (engine/idle_priority.py)
            owner = self._owner()
            if owner is None:
                return
            end_page = min(self.stop, self.done + per_call)
            for plane in range(self.planes):
                start = self.base + (plane * self.plane_pages + self.done) * self.page_bytes
                end = self.base + (plane * self.plane_pages + end_page) * self.page_bytes
                aligned = start // OS_PAGE * OS_PAGE
                if madvise(aligned, end - aligned, MADV_POPULATE_WRITE) != 0:
                    self.failed = os.strerror(ctypes.get_errno())
                    log.info("KV pool prefault off (madvise: %s): pages fault on first use", self.failed)
                    return
            del owner
            self.done = end_page
