"""The KV bookkeeping of running requests: pages from the pool, prefixes in the radix tree,
pages in the L2/L3 tiers, pinned prefixes, and snapshot export/import.

The engine (engine/engine.py) decides *when* a sequence is admitted, grows, is preempted or
finishes; this module does *what that means* for the KV: which pages it holds, which it
shares with the radix tree (and keeps locked there), and which go down to L2/L3 or come
back. Like mini-sglang's scheduler / cache-manager split, the engine never touches the pool
or the tree directly. Everything here runs on the stepping thread (nothing is thread-safe).

A sequence's KV state is `seq.pages` (its page table), of which `seq.pages[:seq.num_shared]`
belong to the radix tree, locked through `seq.node`, and `seq.num_computed` (tokens whose
KV is in those pages).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from preheat.engine.kv import prefix_io
from preheat.engine.kv.pool import KVPool
from preheat.engine.kv.radix import RadixCache, RadixNode
from preheat.engine.kv.snapshot import PrefixRecord
from preheat.engine.kv.tiers import KVTiers, PrefetchTicket, page_keys, root_key
from preheat.engine.request.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedPrefix:
    """What the prefix cache holds for a waiting request, looked up without side effects."""

    length: int  # prompt tokens it would serve (page-aligned)
    # Pages of that prefix counted as evictable today: admitting the request locks them,
    # taking them out of the free headroom.
    evictable_pages: int


class KVCacheManager:
    def __init__(
        self, pool: KVPool, radix: RadixCache | None, tiers: KVTiers | None, fingerprint: dict[str, Any]
    ) -> None:
        self.pool = pool
        self.radix = radix
        self.tiers = tiers if radix is not None else None  # tiers hang off radix eviction
        self.tier_root = root_key(fingerprint)
        if self.tiers is not None:
            self.radix.on_evict = self._offload
        self.tier_hit_tokens = {"l1": 0, "l2": 0, "l3": 0}
        self.tier_restore_seconds: list[float] = []  # L2/L3 -> L1 copy times, drained by metrics
        self.pinned: dict[tuple[int, ...], Any] = {}

    # --- capacity ------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        """Pages an allocation can get: free ones plus cached ones nobody holds."""
        return self.pool.num_free_pages + (self.radix.evictable_pages if self.radix else 0)

    @property
    def cached_pages(self) -> int:
        return self.radix.total_pages if self.radix else 0

    def all_free(self) -> bool:
        """Whether an empty engine would have the whole pool (nothing pinned or locked)."""
        return self.free_pages >= self.pool.capacity_pages

    def alloc(self, n: int) -> list[int] | None:
        """n pages, evicting unlocked cached prefixes when the pool is short; None when even
        that is not enough."""
        pages = self.pool.alloc(n)
        if pages is None and self.radix is not None:
            self.radix.evict(n - self.pool.num_free_pages)
            pages = self.pool.alloc(n)
        return pages

    def grow(self, seq: Sequence, num_pages: int) -> bool:
        """Gives the sequence the num_pages the step plan granted it; False when they cannot
        be had (the sequence keeps what it holds)."""
        if num_pages <= 0:
            return True
        pages = self.alloc(num_pages)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Frees the pages past those holding the first num_tokens tokens: after speculative
        decoding rejected draft tokens, pages that held only their KV go back to the pool
        (rejected KV in a kept page is overwritten when those positions are computed again).
        Never touches shared pages: they hold computed, verified tokens only."""
        keep = max(-(-num_tokens // self.pool.page_size), seq.num_shared)
        extra = seq.pages[keep:]
        if extra:
            del seq.pages[keep:]
            self.pool.free(extra)

    # --- a sequence's life ---------------------------------------------------------------
    def peek_prefix(self, token_ids: list[int]) -> CachedPrefix:
        """The cached prefix a waiting request would start from (for the planner); touches
        nothing, so looking every step does not refresh LRU order."""
        if self.radix is None:
            return CachedPrefix(0, 0)
        match = self.radix.match_prefix(token_ids[: len(token_ids) - 1], touch=False)
        return CachedPrefix(match.length, self._evictable_on_path(match.node))

    def _evictable_on_path(self, node: RadixNode) -> int:
        total = 0
        while node is not self.radix.root:
            if node.lock_ref == 0 and node.pin_count == 0:
                total += len(node.pages)
            node = node.parent
        return total

    def prefetch_pending(self, seq: Sequence) -> bool:
        """Whether this waiting sequence is still waiting for L3 pages (prefetch policies
        wait_complete and timeout): the first time it is looked at, the loads of the pages
        beyond its L1 match start in the background, and until they are back (or the timeout
        passed) the planner does not see it. It waits alone; the batch keeps running."""
        if self.tiers is None or not self.tiers.prefetcher.waits or seq.prefetch is False:
            return False
        if seq.prefetch is None:
            keys = self._tier_keys(seq.all_token_ids[: seq.max_cached_prefix], self.radix_pages(seq))
            seq.prefetch = (self.tiers.start(keys) if keys else None) or False
            if seq.prefetch is False:
                return False
        return not seq.prefetch.ready()

    def wait_prefetch(self, seqs: Any, timeout: float) -> bool:
        """Blocks up to `timeout` on the first of `seqs` still waiting for L3 pages (the step
        thread, when nothing else can run); False when none is."""
        for seq in seqs:
            if isinstance(seq.prefetch, PrefetchTicket) and not seq.prefetch.ready():
                seq.prefetch.wait(timeout)
                return True
        return False

    def radix_pages(self, seq: Sequence) -> int:
        """Pages of the sequence's prefix (as far as it may be served from cache) in L1."""
        return len(self.radix.match_prefix(seq.all_token_ids[: seq.max_cached_prefix], touch=False).pages)

    def _tier_keys(self, tokens: list[int], start_page: int) -> list[str]:
        """Keys of the pages of `tokens` from `start_page` on, when the first is in L2/L3."""
        ps = self.pool.page_size
        aligned = tokens[: len(tokens) - len(tokens) % ps]
        if start_page * ps >= len(aligned):
            return []
        keys = page_keys(aligned, ps, self.tier_root)[start_page:]
        return keys if self.tiers.locate(keys[:1])[0] is not None else []

    def admit(self, seq: Sequence) -> int:
        """Starts a sequence from its longest cached prefix (extended from L2/L3 where the
        tiers have more), locked so it cannot be evicted while the sequence runs. Returns the
        tokens brought back from L2/L3: that many more than `peek_prefix` saw."""
        if self.radix is None:
            return 0
        tokens = seq.all_token_ids[: seq.max_cached_prefix]
        match = self.radix.match_prefix(tokens)
        self.radix.lock(match.node)
        seq.node, seq.pages = match.node, list(match.pages)
        seq.num_shared, seq.num_computed = len(match.pages), match.length
        if self.tiers is not None:
            self._bring_back(tokens, seq)
            seq.prefetch = None  # consumed; a preempted sequence looks again
        self.tier_hit_tokens["l1"] += match.length
        return seq.num_computed - match.length

    def cache_progress(self, seq: Sequence) -> None:
        """Hands the sequence's fully computed pages to the radix tree so other requests
        (and this one after a preemption) can reuse them."""
        if self.radix is None:
            return
        ps = self.pool.page_size
        full = seq.num_computed // ps
        if full <= seq.num_shared:
            return
        tree_pages, node = self.radix.insert(seq.all_token_ids[: full * ps], seq.pages[:full])
        duplicates = [seq.pages[i] for i in range(seq.num_shared, full) if tree_pages[i] != seq.pages[i]]
        seq.pages[:full] = tree_pages
        self.radix.lock(node)
        if seq.node is not None:
            self.radix.unlock(seq.node)
        seq.node = node
        seq.num_shared = full
        if duplicates:
            self.pool.free(duplicates)

    def release(self, seq: Sequence) -> None:
        """Gives back everything the sequence holds; what it computed stays cached. Used when
        it finishes and when it is preempted (it then recomputes from the cache)."""
        self.cache_progress(seq)
        if seq.node is not None and self.radix is not None:
            self.radix.unlock(seq.node)
        private = seq.pages[seq.num_shared :]
        if private:
            self.pool.free(private)
        seq.pages, seq.node, seq.num_shared, seq.num_computed = [], None, 0, 0

    # --- pinned prefixes and snapshots -------------------------------------------------
    def pin_prefix(self, token_ids: list[int]) -> int:
        """Keeps the cached, page-aligned part of this prefix from eviction. Returns the
        tokens pinned: 0 when the prefix is not cached yet (run it first)."""
        if self.radix is None:
            return 0
        ps = self.pool.page_size
        aligned = list(token_ids[: len(token_ids) - len(token_ids) % ps])
        match = self.radix.match_prefix(aligned, touch=False)
        if match.length == 0:
            return 0
        key = tuple(aligned[: match.length])
        if key not in self.pinned:
            self.radix.pin(match.node)
            self.pinned[key] = match.node
        return match.length

    def export_prefixes(self, max_tokens: int | None) -> list[PrefixRecord]:
        """The hottest cached prefixes with their KV, pinned first."""
        if self.radix is None:
            return []
        return prefix_io.export_prefixes(self.pool, self.radix, max_tokens)

    def import_prefixes(self, records: list[PrefixRecord]) -> int:
        """Puts restored prefixes into the cache, pinning those recorded as pinned; returns
        tokens of KV restored. Records come prefix-first: one that extends another
        (kv_start > 0) needs that one in the cache."""
        if self.radix is None:
            return 0
        restored = 0
        for record in records:
            tokens = list(record.token_ids)
            have = self.radix.match_prefix(tokens, touch=False).length
            if have < record.kv_start:
                log.warning("snapshot: skipping a prefix whose first %d tokens are not cached", record.kv_start)
                continue
            node = prefix_io.import_prefix(
                self.pool, self.radix, tokens,
                lambda start, end, r=record: r.kv[:, :, start - r.kv_start : end - r.kv_start], self.alloc,
            )
            if node is None:
                log.warning("snapshot: no room in the KV pool for the remaining prefixes")
                break
            node.hits = max(node.hits, record.hits)
            restored += len(tokens) - have
            if record.pinned:
                self.pin_prefix(tokens)
        return restored

    # --- L2/L3 tiers -----------------------------------------------------------------------
    def _offload(self, path_tokens: list[int], pages: list[int]) -> None:
        """Radix eviction hook: evicted pages go down to L2/L3 instead of being dropped."""
        assert self.tiers is not None
        try:  # never raises: the radix tree frees the pages whatever happens here
            keys = page_keys(path_tokens, self.pool.page_size, self.tier_root)[-len(pages):]
            kv = prefix_io.read_pages(self.pool, pages)
            ps = self.pool.page_size
            for i, key in enumerate(keys):
                self.tiers.offload(key, kv[:, :, i * ps : (i + 1) * ps].contiguous())
        except Exception as e:  # the pages are dropped instead of kept below L1
            self.tiers.record_error(self.tiers.first_tier, "write", e)

    def _bring_back(self, tokens: list[int], seq: Sequence) -> None:
        """Extends a radix match with pages found in L2/L3 (by the prefetch policy), then
        re-matches so the sequence starts after them. A failure is a miss: the sequence
        keeps the match it had and computes the rest."""
        assert self.tiers is not None
        try:
            self._extend_from_tiers(tokens, seq)
        except Exception as e:
            self.tiers.record_error(self.tiers.first_tier, "read", e)

    def _extend_from_tiers(self, tokens: list[int], seq: Sequence) -> None:
        assert self.radix is not None and self.tiers is not None
        ps = self.pool.page_size
        aligned = tokens[: len(tokens) - len(tokens) % ps]
        start_page = seq.num_shared
        keys = self._tier_keys(tokens, start_page)
        if not keys:
            return
        t0 = time.perf_counter()
        ticket = seq.prefetch
        # Loaded while it waited: take what arrived, never wait here (the step thread).
        fetched = self.tiers.collect(keys, ticket) if isinstance(ticket, PrefetchTicket) else self.tiers.fetch(keys)
        if not fetched.pages:
            return
        n = len(fetched.pages)
        end = (start_page + n) * ps
        kv = torch.cat(fetched.pages, dim=2)
        node = prefix_io.import_prefix(
            self.pool, self.radix, aligned[:end], lambda a, b: kv[:, :, a - start_page * ps : b - start_page * ps],
            self.alloc,
        )
        if node is None:
            return
        self.tier_restore_seconds.append(time.perf_counter() - t0)
        for tier in fetched.tiers:
            self.tier_hit_tokens[tier] += ps
        match = self.radix.match_prefix(tokens)
        self.radix.lock(match.node)
        self.radix.unlock(seq.node)
        seq.node, seq.pages = match.node, list(match.pages)
        seq.num_shared, seq.num_computed = len(match.pages), match.length
