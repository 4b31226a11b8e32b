"""The CPU KV pool's prefaulter (engine/kv/prefault.py): a background thread gives the pool's
lowest pages — the first handed out — their memory up to a budget, leaves the rest to first
touch, ends with its pool, and changes nothing the pool holds."""

from __future__ import annotations

import ctypes
import gc
import time

import torch

from preheat.engine.kv.pool import KVPool
from preheat.engine.kv.prefault import OS_PAGE

LAYERS, HEADS, DIM, PAGES, PAGE = 4, 4, 64, 2048, 16  # float32: 16 KiB a page a plane, 256 MiB
PLANES = 2 * LAYERS
PAGE_BYTES = PAGE * HEADS * DIM * 4
BUDGET = 16 * 2**20
PER_PLANE = BUDGET // (PLANES * PAGE_BYTES)  # 128 pages of each plane

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def resident(pool: KVPool, plane: int, page: int) -> bool:
    """Whether the OS page holding the middle of `page` of `plane` has memory (mincore)."""
    addr = pool.kv.data_ptr() + (plane * PAGES + page) * PAGE_BYTES + PAGE_BYTES // 2
    vec = ctypes.create_string_buffer(1)
    assert _libc.mincore(addr // OS_PAGE * OS_PAGE, OS_PAGE, vec) == 0
    return bool(vec.raw[0] & 1)


def make_pool(budget: int = BUDGET) -> KVPool:
    return KVPool(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, num_pages=PAGES, page_size=PAGE,
                  dtype=torch.float32, device=torch.device("cpu"), prefault_bytes=budget)


def finished(pool: KVPool) -> None:
    """Waits for the thread (idle priority: it may wait for a core; a deadline, not a race)."""
    pool._prefault.join(timeout=120)
    assert not pool._prefault._thread.is_alive()
    assert pool._prefault.failed is None


def test_the_lowest_pages_of_every_plane_get_memory_up_to_the_budget_and_no_more() -> None:
    pool = make_pool()
    finished(pool)
    assert pool._prefault.done == pool._prefault.stop == 1 + PER_PLANE
    for plane in range(PLANES):
        assert resident(pool, plane, 1) and resident(pool, plane, PER_PLANE)
        assert not resident(pool, plane, PER_PLANE + 8)
        assert not resident(pool, plane, PAGES - 1)
    assert pool.alloc(3) == [1, 2, 3]  # the pages handed out first are the populated ones


def test_populating_keeps_what_the_pool_holds() -> None:
    pool = make_pool()
    pool.k(1)[5].fill_(3.0)  # written while the thread may be populating
    pool.v(3)[PER_PLANE + 40].fill_(2.0)  # beyond the budget: faults as ever
    finished(pool)
    assert pool.k(1)[5].eq(3.0).all() and pool.v(3)[PER_PLANE + 40].eq(2.0).all()
    assert pool.kv.sum() == 5.0 * PAGE * HEADS * DIM


def test_no_budget_means_no_thread_and_no_memory() -> None:
    pool = make_pool(budget=0)
    assert pool._prefault is None
    pool.alloc(100)
    time.sleep(0.1)
    assert not resident(pool, 0, 1) and not resident(pool, PLANES - 1, 50)


def test_a_budget_beyond_the_pool_populates_the_pool() -> None:
    pool = make_pool(budget=10 * 2**30)
    finished(pool)
    assert pool._prefault.done == PAGES
    assert resident(pool, PLANES - 1, PAGES - 1)


def test_the_thread_ends_with_its_pool() -> None:
    pool = make_pool(budget=10 * 2**30)
    prefault = pool._prefault
    del pool
    gc.collect()
    prefault.join(timeout=120)
    assert not prefault._thread.is_alive()


def test_without_the_call_pages_just_fault(monkeypatch) -> None:
    from preheat.engine.kv import prefault

    monkeypatch.setattr(prefault, "_madvise", lambda: None)
    pool = make_pool()
    pool._prefault.join(timeout=120)
    assert pool._prefault.failed == "no madvise" and not resident(pool, 0, 1)
    pool.k(0)[1].fill_(1.0)
    assert pool.kv.sum() == PAGE * HEADS * DIM
