"""The paged KV pool: pages are integers on a free list, page 0 is scratch, sizing follows
the seed formula."""

from __future__ import annotations

import pytest
import torch

from preheat.engine.kv.pool import SCRATCH_PAGE, KVPool, pool_pages, zeroed


def make_pool(num_pages: int = 9, page_size: int = 4) -> KVPool:
    return KVPool(
        num_layers=2,
        num_kv_heads=2,
        head_dim=3,
        num_pages=num_pages,
        page_size=page_size,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_the_kv_tensor_has_the_documented_shape_and_k_v_are_views() -> None:
    pool = make_pool(num_pages=5, page_size=4)
    assert pool.kv.shape == (2, 2, 5, 4, 2, 3)
    # k/v must be views: the attention kernels write into them in place.
    pool.k(1)[3, 2, 1, 0] = 7.0
    pool.v(0)[1, 0, 0, 2] = 5.0
    assert pool.kv[1, 0, 3, 2, 1, 0] == 7.0
    assert pool.kv[0, 1, 1, 0, 0, 2] == 5.0
    assert pool.bytes == pool.kv.numel() * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_a_cpu_pool_starts_zero_in_every_dtype_and_is_writable(dtype) -> None:
    t = zeroed((2, 3, 5, 4), dtype, torch.device("cpu"))
    assert (t.shape, t.dtype, t.is_contiguous()) == ((2, 3, 5, 4), dtype, True)
    assert t.float().abs().sum() == 0
    t[1, 2] = 1.0
    assert t.float().sum() == 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_cpu_pool_is_not_written_at_start_only_the_pages_touched_take_memory() -> None:
    """Start-up does not memset the pool (a second of a 2-core start for ~1 GiB): its
    memory comes from the kernel's zero pages, on first touch."""
    before = _rss_bytes()
    pool = KVPool(num_layers=4, num_kv_heads=4, head_dim=64, num_pages=2048, page_size=16,
                  dtype=torch.float32, device=torch.device("cpu"), prefault_bytes=0)  # 256 MiB
    assert pool.bytes == 256 * 2**20
    assert _rss_bytes() - before < 32 * 2**20
    pool.k(0)[1:3].fill_(1.0)  # two pages of one layer's K
    assert _rss_bytes() - before < 32 * 2**20 and pool.kv.sum() == 2 * 16 * 4 * 64


def test_a_fresh_pool_hands_out_every_page_but_scratch_once() -> None:
    pool = make_pool(num_pages=9)
    assert pool.capacity_pages == 8
    assert pool.num_free_pages == 8 and pool.num_used_pages == 0
    pages = pool.alloc(8)
    assert pages is not None
    assert sorted(pages) == list(range(1, 9))  # page 0 is scratch: never handed out
    assert SCRATCH_PAGE not in pages
    assert pool.num_free_pages == 0 and pool.num_used_pages == 8


def test_a_fresh_pool_fills_from_the_front() -> None:
    pool = make_pool(num_pages=9)
    assert pool.alloc(1) == [1]
    assert sorted(pool.alloc(2) or []) == [2, 3]


def test_a_sequences_pages_ascend_in_memory() -> None:
    """The CPU's prefetchers follow ascending addresses from page to page: one allocation's
    pages come in ascending order, also once freed pages are handed out again."""
    pool = make_pool(num_pages=17)
    first = pool.alloc(5)
    assert first == [1, 2, 3, 4, 5]
    assert pool.alloc(3) == [6, 7, 8]
    pool.free(first)
    assert pool.alloc(4) == [1, 2, 3, 4]
    assert pool.alloc(3) == [5, 9, 10]


def test_alloc_returns_none_when_short_and_takes_nothing() -> None:
    pool = make_pool(num_pages=5)
    assert pool.alloc(3) is not None
    assert pool.alloc(2) is None  # one page left: the caller evicts or preempts
    assert pool.num_free_pages == 1  # a refused alloc must not take pages
    assert pool.alloc(1) is not None
    assert pool.alloc(1) is None


def test_alloc_zero_is_an_empty_list_not_none() -> None:
    pool = make_pool()
    assert pool.alloc(0) == []
    pool.alloc(pool.num_free_pages)
    assert pool.alloc(0) == []  # even when full: asking for nothing always succeeds


def test_freed_pages_are_handed_out_again() -> None:
    pool = make_pool(num_pages=5)
    pages = pool.alloc(4)
    assert pages is not None
    pool.free(pages[1:3])
    assert pool.num_free_pages == 2
    again = pool.alloc(2)
    assert again is not None and sorted(again) == sorted(pages[1:3])


def test_double_free_raises() -> None:
    pool = make_pool()
    pages = pool.alloc(2)
    assert pages is not None
    pool.free(pages)
    with pytest.raises(ValueError):
        pool.free(pages[:1])
    assert pool.num_free_pages == pool.capacity_pages  # the bad call changed nothing


def test_freeing_a_never_allocated_page_raises() -> None:
    pool = make_pool(num_pages=5)
    with pytest.raises(ValueError):
        pool.free([3])  # free already: a double free in disguise


def test_freeing_the_scratch_page_or_an_out_of_range_id_raises() -> None:
    pool = make_pool(num_pages=5)
    pool.alloc(4)
    for bad in ([SCRATCH_PAGE], [5], [-1], [99]):
        with pytest.raises(ValueError):
            pool.free(bad)
    assert pool.num_free_pages == 0


def test_a_bad_id_in_a_batch_frees_none_of_the_batch() -> None:
    # Validation happens before any page goes back, so a failed free leaves no half state.
    pool = make_pool(num_pages=5)
    pages = pool.alloc(4)
    assert pages is not None
    with pytest.raises(ValueError):
        pool.free([pages[0], SCRATCH_PAGE])
    assert pool.num_free_pages == 0


def test_a_pool_needs_a_page_besides_scratch() -> None:
    with pytest.raises(ValueError):
        make_pool(num_pages=1)


# --- sizing ---------------------------------------------------------------------------------


def test_pool_pages_follows_the_seed_formula_plus_scratch() -> None:
    # tokens = free_memory x fraction / kv_bytes_per_token = 1_000_000 x 0.5 / 100 = 5000;
    # 5000 // 16 = 312 pages, + 1 scratch page.
    assert pool_pages(100, 1_000_000, 0.5, 16, None) == 313


def test_pool_pages_rounds_tokens_down_to_whole_pages() -> None:
    # 1000 x 1.0 / 10 = 100 tokens: 6 whole pages of 16 (96 tokens), never a partial page.
    assert pool_pages(10, 1000, 1.0, 16, None) == 7


def test_max_total_tokens_caps_the_pool_only_when_smaller() -> None:
    assert pool_pages(100, 1_000_000, 0.5, 16, 160) == 11  # 160 tokens = 10 pages + scratch
    assert pool_pages(100, 1_000_000, 0.5, 16, 10**9) == 313  # a cap above the formula is moot


def test_pool_pages_uses_the_documented_kv_bytes_per_token() -> None:
    # SmolLM2-135M in bf16: 2 x 30 layers x 3 KV heads x 64 head_dim x 2 bytes = 23040 B/token.
    kv_bytes = 2 * 30 * 3 * 64 * 2
    one_gib = 2**30
    expected_tokens = int(one_gib * 0.1 / kv_bytes)
    assert pool_pages(kv_bytes, one_gib, 0.1, 16, None) == expected_tokens // 16 + 1


def test_pool_pages_refuses_when_not_even_one_page_fits() -> None:
    with pytest.raises(ValueError, match="no room for a KV pool"):
        pool_pages(1000, 10_000, 1.0, 16, None)  # 10 tokens < one page of 16
    with pytest.raises(ValueError):
        pool_pages(100, 10**9, 0.5, 16, 15)  # the cap leaves less than a page


def test_a_page_twice_in_one_free_call_is_a_double_free() -> None:
    # Otherwise the page lands on the free list twice and is later handed to two owners.
    pool = make_pool(num_pages=5)
    pages = pool.alloc(2)
    assert pages is not None
    with pytest.raises(ValueError):
        pool.free([pages[0], pages[0]])
    assert pool.num_free_pages == 2
    pool.free(pages)
    handed_out = pool.alloc(pool.num_free_pages)
    assert handed_out is not None and len(set(handed_out)) == len(handed_out) == 4


def _cgroup(tmp_path, limit: str, usage: str, version: int = 2, stat: str | None = None):
    names = ("memory.max", "memory.current") if version == 2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    (tmp_path / names[0]).write_text(limit + "\n")
    (tmp_path / names[1]).write_text(usage + "\n")
    if stat is not None:
        (tmp_path / "memory.stat").write_text(stat)
    key = "inactive_file" if version == 2 else "total_inactive_file"
    return ((str(tmp_path / names[0]), str(tmp_path / names[1]), str(tmp_path / "memory.stat"), key),)


def test_a_containers_memory_limit_bounds_what_the_pool_may_take(tmp_path) -> None:
    """In a pod /proc/meminfo is the node's: the cgroup's limit minus its usage is the room."""
    from preheat.engine.kv.pool import cgroup_headroom_bytes

    assert cgroup_headroom_bytes(_cgroup(tmp_path, str(8 << 30), str(3 << 30))) == 5 << 30
    (tmp_path / "over").mkdir()
    assert cgroup_headroom_bytes(_cgroup(tmp_path / "over", str(1 << 30), str(2 << 30))) == 0  # over the limit


def test_the_page_cache_of_read_files_is_room_not_use(tmp_path) -> None:
    """A model read through the page cache is charged to the pod; the kernel reclaims its
    inactive part before an OOM kill (the kubelet's working set leaves it out too), so it
    must not shrink the pool. Active file pages and anonymous memory still count."""
    from preheat.engine.kv.pool import cgroup_headroom_bytes

    stat = f"anon {2 << 30}\nfile {5 << 30}\nactive_file {1 << 30}\ninactive_file {4 << 30}\nslab 123\n"
    assert cgroup_headroom_bytes(_cgroup(tmp_path, str(8 << 30), str(7 << 30), stat=stat)) == 5 << 30
    (tmp_path / "v1").mkdir()
    stat_v1 = f"cache {5 << 30}\ninactive_file 1\ntotal_inactive_file {4 << 30}\n"  # the hierarchy's total counts
    assert cgroup_headroom_bytes(_cgroup(tmp_path / "v1", str(8 << 30), str(7 << 30), 1, stat_v1)) == 5 << 30
    (tmp_path / "odd").mkdir()  # more inactive cache than usage (racing reads): never more than the limit
    assert (
        cgroup_headroom_bytes(_cgroup(tmp_path / "odd", str(8 << 30), str(1 << 30), stat=f"inactive_file {2 << 30}\n"))
        == 8 << 30
    )
    (tmp_path / "bad").mkdir()  # an unreadable stat: the usage as it is
    assert (
        cgroup_headroom_bytes(_cgroup(tmp_path / "bad", str(8 << 30), str(7 << 30), stat="inactive_file x\n"))
        == 1 << 30
    )


def test_cgroup_v1_limits_count_and_unlimited_ones_do_not(tmp_path) -> None:
    from preheat.engine.kv.pool import cgroup_headroom_bytes

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert cgroup_headroom_bytes(_cgroup(tmp_path / "a", str(4 << 30), str(1 << 30), version=1)) == 3 << 30
    assert cgroup_headroom_bytes(_cgroup(tmp_path / "b", "9223372036854771712", "12345", version=1)) is None


def test_no_limit_or_no_cgroup_leaves_the_node_figure(tmp_path) -> None:
    from preheat.engine.kv.pool import cgroup_headroom_bytes

    assert cgroup_headroom_bytes(_cgroup(tmp_path, "max", "123")) is None
    none = str(tmp_path / "none")
    assert cgroup_headroom_bytes(((none, none + "2", none + "3", "inactive_file"),)) is None


def test_available_memory_is_the_smaller_of_the_node_and_the_container(monkeypatch) -> None:
    from preheat.engine.kv import pool as pool_module

    node = pool_module.available_memory_bytes(torch.device("cpu"))
    monkeypatch.setattr(pool_module, "cgroup_headroom_bytes", lambda: 1 << 20)
    assert pool_module.available_memory_bytes(torch.device("cpu")) == min(node, 1 << 20)
    monkeypatch.setattr(pool_module, "cgroup_headroom_bytes", lambda: None)
    assert pool_module.available_memory_bytes(torch.device("cpu")) > 0
