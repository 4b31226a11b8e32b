"""KV tiers: page keys, the L2 host store, the L3 disk store, and the three prefetch policies."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from preheat.engine.config import EngineConfig
from preheat.engine.kv.tiers import (
    DiskPageStore,
    HostPageStore,
    KVTiers,
    Prefetcher,
    page_key,
    page_keys,
    root_key,
)

from .snapshot_helpers import fingerprint

PAGE = 4
ROOT = root_key(fingerprint())


def page(seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, PAGE, 2, 4, generator=g).to(dtype)  # [layers, 2, page, kvh, hd]


PAGE_BYTES = page(0).numel() * 2


def keys_for(tokens: list[int]) -> list[str]:
    return page_keys(tokens, PAGE, ROOT)


# --------------------------------------------------------------------------- keys


def test_a_page_key_depends_on_everything_before_it():
    a = keys_for([1, 2, 3, 4, 5, 6, 7, 8])
    b = keys_for([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1]  # same tokens 5..8, different history, different KV
    assert a == keys_for([1, 2, 3, 4, 5, 6, 7, 8, 9])  # the partial last page has no key
    assert a[1] == page_key(a[0], [5, 6, 7, 8])  # the radix tree can extend a parent's key


def test_keys_of_another_model_never_collide():
    other = root_key(fingerprint(page_size=8))
    assert page_keys([1, 2, 3, 4], PAGE, other) != keys_for([1, 2, 3, 4])


def test_keys_are_32_hex_digits():
    (k,) = keys_for([1, 2, 3, 4])
    assert len(k) == 32 and int(k, 16) >= 0


# --------------------------------------------------------------------------- L2


def test_l2_keeps_pages_within_its_byte_capacity_evicting_least_recently_used():
    spilled: list[str] = []
    l2 = HostPageStore(3 * PAGE_BYTES, on_evict=lambda k, kv: spilled.append(k))
    k = keys_for(list(range(4 * PAGE)))
    for i in range(3):
        l2.put(k[i], page(i))
    assert l2.get(k[0]) is not None  # k[0] is now the most recently used
    l2.put(k[3], page(3))
    assert spilled == [k[1]] and k[1] not in l2 and k[0] in l2
    assert (l2.stats.evictions, l2.stats.bytes_used, len(l2)) == (1, 3 * PAGE_BYTES, 3)


def test_l2_hands_evicted_pages_to_the_next_tier_intact():
    got: dict[str, torch.Tensor] = {}
    l2 = HostPageStore(PAGE_BYTES, on_evict=lambda k, kv: got.__setitem__(k, kv))
    k = keys_for(list(range(2 * PAGE)))
    l2.put(k[0], page(0))
    l2.put(k[1], page(1))
    assert torch.equal(got[k[0]], page(0))


def test_l2_stores_a_copy_not_the_pools_memory():
    src = page(1)
    l2 = HostPageStore(10 * PAGE_BYTES)
    (k,) = keys_for([1, 2, 3, 4])
    l2.put(k, src)
    src.zero_()  # the L1 page is reused for another sequence
    assert torch.equal(l2.get(k), page(1))


def test_a_page_larger_than_l2_goes_straight_to_the_next_tier():
    spilled: list[str] = []
    l2 = HostPageStore(PAGE_BYTES - 1, on_evict=lambda k, kv: spilled.append(k))
    (k,) = keys_for([1, 2, 3, 4])
    assert l2.put(k, page(0)) is False
    assert spilled == [k] and len(l2) == 0 and l2.stats.too_large == 1


def test_a_failing_next_tier_does_not_break_l2():
    def broken(k, kv):
        raise OSError("disk full")

    l2 = HostPageStore(PAGE_BYTES, on_evict=broken)
    k = keys_for(list(range(2 * PAGE)))
    l2.put(k[0], page(0))
    assert l2.put(k[1], page(1)) and k[1] in l2


def test_l2_counts_hits_and_misses_and_pop_frees_bytes():
    l2 = HostPageStore(10 * PAGE_BYTES)
    (k,) = keys_for([1, 2, 3, 4])
    assert l2.get(k) is None
    l2.put(k, page(0))
    l2.get(k)
    assert (l2.stats.hits, l2.stats.misses) == (1, 1)
    assert torch.equal(l2.pop(k), page(0)) and l2.stats.bytes_used == 0


def test_keys_that_are_not_hex_are_refused_before_they_reach_a_file_name(tmp_path):
    for store in (HostPageStore(PAGE_BYTES), DiskPageStore(tmp_path, 10 * PAGE_BYTES)):
        with pytest.raises(ValueError):
            store.put("../../etc/passwd", page(0))


# --------------------------------------------------------------------------- L3


def test_l3_round_trips_pages_and_survives_a_restart(tmp_path):
    k = keys_for(list(range(2 * PAGE)))
    l3 = DiskPageStore(tmp_path, 100 * PAGE_BYTES)
    l3.put(k[0], page(0))
    l3.put(k[1], page(1, torch.float32))
    again = DiskPageStore(tmp_path, 100 * PAGE_BYTES)
    assert torch.equal(again.get(k[0]), page(0)) and torch.equal(again.get(k[1]), page(1, torch.float32))
    assert again.stats.bytes_used == l3.stats.bytes_used and len(again) == 2


def test_l3_evicts_least_recently_used_files_beyond_its_capacity_and_counts_them(tmp_path):
    k = keys_for(list(range(4 * PAGE)))
    probe = DiskPageStore(tmp_path / "probe", 10**9)
    probe.put(k[0], page(0))
    file_size = probe.stats.bytes_used
    l3 = DiskPageStore(tmp_path / "l3", 3 * file_size)
    for i in range(3):
        l3.put(k[i], page(i))
    l3.get(k[0])
    l3.put(k[3], page(3))
    assert k[1] not in l3 and l3.get(k[1]) is None and k[0] in l3
    assert l3.stats.evictions == 1 and l3.stats.bytes_used <= 3 * file_size
    assert sorted(p.name for p in tmp_path.glob("l3/*/*")) == sorted(f"{x}.safetensors" for x in (k[0], k[2], k[3]))


def test_a_smaller_capacity_after_restart_evicts_the_oldest_files(tmp_path):
    k = keys_for(list(range(3 * PAGE)))
    l3 = DiskPageStore(tmp_path, 10**9)
    for i, key in enumerate(k):
        l3.put(key, page(i))
        os.utime(l3._path(key), (1000 + i, 1000 + i))
    size = l3.stats.bytes_used // 3
    again = DiskPageStore(tmp_path, 2 * size)
    assert k[0] not in again and k[1] in again and k[2] in again and again.stats.evictions == 1


def _corrupt(l3: DiskPageStore, key: str, how: str) -> None:
    path = l3._path(key)
    data = bytearray(path.read_bytes())
    if how == "bitflip":
        data[-3] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[:-10]))
    elif how == "garbage":
        path.write_bytes(b"\x00" * len(data))


@pytest.mark.parametrize("how", ["bitflip", "truncate", "garbage"])
def test_a_corrupt_l3_page_is_a_miss_counted_and_deleted(tmp_path, how):
    (k,) = keys_for([1, 2, 3, 4])
    l3 = DiskPageStore(tmp_path, 10**9)
    l3.put(k, page(0))
    _corrupt(l3, k, how)
    assert l3.get(k) is None
    assert l3.stats.corrupt == 1 and k not in l3 and not l3._path(k).exists() and l3.stats.bytes_used == 0


def test_an_l3_file_renamed_to_another_key_is_refused(tmp_path):
    a, b = keys_for(list(range(2 * PAGE)))
    l3 = DiskPageStore(tmp_path, 10**9)
    l3.put(a, page(0))
    l3._path(b).parent.mkdir(exist_ok=True)
    os.replace(l3._path(a), l3._path(b))
    again = DiskPageStore(tmp_path, 10**9)
    assert again.get(b) is None and again.stats.corrupt == 1


def test_l3_removes_writes_cut_short_by_a_crash(tmp_path):
    (k,) = keys_for([1, 2, 3, 4])
    (tmp_path / k[:2]).mkdir()
    stale = tmp_path / k[:2] / f".tmp-{k}-dead"
    stale.write_bytes(b"half a page")
    DiskPageStore(tmp_path, 10**9)
    assert not stale.exists()


def test_a_page_larger_than_l3_is_not_stored(tmp_path):
    (k,) = keys_for([1, 2, 3, 4])
    l3 = DiskPageStore(tmp_path, 10)
    assert l3.put(k, page(0)) is False and len(l3) == 0 and l3.stats.too_large == 1


# --------------------------------------------------------------------------- prefetch


class SlowDisk(DiskPageStore):
    """An L3 whose reads take `delay` seconds and are counted."""

    delay = 0.0

    def get(self, key):
        self.reads = getattr(self, "reads", 0) + 1
        time.sleep(self.delay)
        return super().get(key)


def stores(tmp_path: Path, n_l2: int, n_l3: int, delay: float = 0.0):
    """Tokens with n_l2 + n_l3 pages: the first n_l2 in L2, the next n_l3 only in L3."""
    keys = keys_for(list(range((n_l2 + n_l3) * PAGE)))
    l3 = SlowDisk(tmp_path, 10**9)
    l3.delay = delay
    l2 = HostPageStore(10**9, on_evict=l3.put)
    for i, k in enumerate(keys):
        (l2 if i < n_l2 else l3).put(k, page(i))
    return keys, l2, l3


def test_best_effort_returns_the_l2_run_now_and_loads_l3_into_l2_for_next_time(tmp_path):
    keys, l2, l3 = stores(tmp_path, 2, 2, delay=0.05)
    p = Prefetcher(l2, l3, "best_effort")
    first = p.fetch(keys)
    assert first.tiers == ["l2", "l2"] and first.pending == 2 and not first.complete
    assert first.waited_s < 0.04  # it did not wait for the disk
    p.close()  # waits for the background loads
    second = Prefetcher(l2, l3, "best_effort").fetch(keys)
    assert second.tiers == ["l2"] * 4 and all(torch.equal(x, page(i)) for i, x in enumerate(second.pages))


def test_wait_complete_blocks_until_every_page_is_back(tmp_path):
    keys, l2, l3 = stores(tmp_path, 1, 3, delay=0.02)
    r = Prefetcher(l2, l3, "wait_complete").fetch(keys)
    assert r.complete and r.tiers == ["l2", "l3", "l3", "l3"] and r.pending == 0
    assert all(torch.equal(x, page(i)) for i, x in enumerate(r.pages))
    assert all(k in l2 for k in keys)  # promoted for the next match


def test_timeout_returns_what_arrived_by_the_deadline_and_keeps_loading(tmp_path):
    keys, l2, l3 = stores(tmp_path, 1, 2, delay=0.5)
    p = Prefetcher(l2, l3, "timeout", timeout_ms=20)
    r = p.fetch(keys)
    assert r.tiers == ["l2"] and r.pending == 2 and 0.015 < r.waited_s < 0.4
    p.close()
    assert all(k in l2 for k in keys)


def test_timeout_gets_everything_when_the_disk_is_fast_enough(tmp_path):
    keys, l2, l3 = stores(tmp_path, 0, 3)
    r = Prefetcher(l2, l3, "timeout", timeout_ms=5000).fetch(keys)
    assert r.complete and r.tiers == ["l3"] * 3 and r.waited_s < 4


def test_a_corrupt_or_missing_page_ends_the_usable_run(tmp_path):
    keys, l2, l3 = stores(tmp_path, 0, 4)
    _corrupt(l3, keys[2], "bitflip")
    r = Prefetcher(l2, l3, "wait_complete").fetch(keys)
    assert len(r.pages) == 2 and not r.complete
    extra = keys_for(list(range(6 * PAGE)))  # pages 4 and 5 were never stored
    assert len(Prefetcher(l2, l3, "wait_complete").fetch(extra).pages) == 2


def test_a_later_page_still_in_l2_is_used_from_l2(tmp_path):
    keys, l2, l3 = stores(tmp_path, 0, 2)
    l2.put(keys[1], page(1))
    r = Prefetcher(l2, l3, "wait_complete").fetch(keys)
    assert r.tiers == ["l3", "l2"] and l3.reads == 1


def test_l3_without_l2_works_with_the_waiting_policies(tmp_path):
    keys, _, l3 = stores(tmp_path, 0, 2)
    r = Prefetcher(None, l3, "wait_complete").fetch(keys)
    assert r.complete and all(torch.equal(x, page(i)) for i, x in enumerate(r.pages))


def test_concurrent_fetches_of_one_page_read_the_disk_once(tmp_path):
    keys, l2, l3 = stores(tmp_path, 0, 1, delay=0.2)
    p = Prefetcher(None, l3, "wait_complete")
    results = []
    threads = [threading.Thread(target=lambda: results.append(p.fetch(keys))) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert l3.reads == 1 and all(r.complete for r in results)


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="best_effort"):
        Prefetcher(None, None, "eventually")


# --------------------------------------------------------------------------- the facade, from the config


def test_tiers_are_off_unless_configured():
    assert KVTiers.from_config(EngineConfig()) is None


def test_an_l1_evicted_prefix_comes_back_bit_identical_through_l2_and_l3(tmp_path):
    cfg = EngineConfig(host_cache_size=2 * PAGE_BYTES / 2**30, disk_cache_dir=str(tmp_path),
                       prefetch_policy="wait_complete")  # fmt: skip
    tiers = KVTiers.from_config(cfg, disk_capacity_bytes=10**9)
    tokens = list(range(5 * PAGE))
    keys = keys_for(tokens)
    for i, k in enumerate(keys):  # L1 evicts the prefix page by page
        tiers.offload(k, page(i))
    assert tiers.locate(keys) == ["l3", "l3", "l3", "l2", "l2"]
    assert tiers.l3.stats.stores == 3 and tiers.l2.stats.evictions == 3
    r = tiers.fetch(keys)
    assert r.complete and all(torch.equal(x, page(i)) for i, x in enumerate(r.pages))
    tiers.close()


def test_with_only_a_disk_tier_offload_writes_to_disk(tmp_path):
    tiers = KVTiers.from_config(EngineConfig(disk_cache_dir=str(tmp_path)), disk_capacity_bytes=10**9)
    (k,) = keys_for([1, 2, 3, 4])
    tiers.offload(k, page(0))
    assert tiers.l2 is None and tiers.locate([k]) == ["l3"]
    tiers.close()
