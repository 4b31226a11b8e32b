"""The radix prefix cache: a page-granular tree over token ids whose nodes own KV pages.

Examples first (each one rule of the tree), then a hypothesis state machine that runs
thousands of random operations against a real pool and re-derives every counter from a
tree walk after each one.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from preheat.engine.kv.pool import KVPool
from preheat.engine.kv.radix import RadixCache, RadixNode

PS = 4  # page size for the examples


def make_pool(num_pages: int = 33, page_size: int = PS) -> KVPool:
    return KVPool(1, 1, 1, num_pages, page_size, torch.float32, torch.device("cpu"))


def make_cache(num_pages: int = 33, page_size: int = PS) -> RadixCache:
    return RadixCache(make_pool(num_pages, page_size))


def cache_tokens(cache: RadixCache, tokens: list[int]) -> tuple[list[int], RadixNode]:
    """What the engine does: pages from the pool, insert, free the duplicates."""
    own = cache.pool.alloc(len(tokens) // cache.page_size)
    assert own is not None
    tree_pages, node = cache.insert(tokens, own)
    cache.pool.free([p for p in own if p not in tree_pages])
    return tree_pages, node


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# --- matching ---------------------------------------------------------------------------------


def test_an_empty_tree_matches_nothing() -> None:
    cache = make_cache()
    m = cache.match_prefix(seq(0, 12))
    assert (m.length, m.pages, m.node) == (0, [], cache.root)


def test_a_match_is_page_aligned_and_never_longer_than_the_tokens() -> None:
    cache = make_cache()
    pages, _ = cache_tokens(cache, seq(0, 12))
    for n in range(0, 14):
        m = cache.match_prefix(seq(0, n))
        assert m.length == min(n, 12) // PS * PS
        assert m.pages == pages[: m.length // PS]
        assert cache.path_tokens(m.node) == seq(0, m.length)


def test_a_partial_last_page_never_matches() -> None:
    # Page-granular: 3 of the 4 tokens of a page are not a hit, the KV page is all or nothing.
    cache = make_cache()
    cache_tokens(cache, seq(0, 8))
    assert cache.match_prefix(seq(0, 7)).length == 4


def test_the_match_stops_at_the_first_page_that_differs() -> None:
    cache = make_cache()
    pages, _ = cache_tokens(cache, seq(0, 16))
    tokens = seq(0, 16)
    tokens[9] = 999  # inside the third page
    m = cache.match_prefix(tokens)
    assert m.length == 8
    assert m.pages == pages[:2]


def test_a_match_ending_inside_a_node_splits_it() -> None:
    cache = make_cache()
    pages, leaf = cache_tokens(cache, seq(0, 12))
    assert len(cache.nodes()) == 1
    m = cache.match_prefix(seq(0, 8))
    # The returned node covers exactly the match, so locking it locks only those pages.
    assert m.node.key == seq(0, 8) and m.node.pages == pages[:2]
    assert leaf.parent is m.node and leaf.key == seq(8, 4) and leaf.pages == pages[2:]
    assert m.node.parent is cache.root
    assert len(cache.nodes()) == 2
    assert cache.total_pages == 3  # a split moves pages, it does not add any
    assert cache.path_pages(leaf) == pages and cache.path_tokens(leaf) == seq(0, 12)


def test_a_mismatch_inside_a_node_splits_it_and_the_new_branch_shares_the_prefix() -> None:
    cache = make_cache()
    pages_a, leaf_a = cache_tokens(cache, seq(0, 12))
    b = seq(0, 8) + [500, 501, 502, 503]
    pages_b, leaf_b = cache_tokens(cache, b)
    assert pages_b[:2] == pages_a[:2]  # the shared prefix is one set of pages
    assert pages_b[2] != pages_a[2]
    assert leaf_a.parent is leaf_b.parent
    assert cache.path_tokens(leaf_b.parent) == seq(0, 8)
    assert cache.total_pages == 4
    assert cache.match_prefix(b).pages == pages_b
    assert cache.match_prefix(seq(0, 12)).pages == pages_a


# --- insertion --------------------------------------------------------------------------------


def test_insert_needs_whole_pages_and_one_page_per_page() -> None:
    cache = make_cache()
    with pytest.raises(ValueError):
        cache.insert(seq(0, 6), [1, 2])  # 6 tokens is not whole pages
    with pytest.raises(ValueError):
        cache.insert(seq(0, 8), [1])  # two pages of tokens, one page id
    assert cache.total_pages == 0 and cache.nodes() == []


def test_inserting_a_cached_prefix_returns_the_trees_pages_so_the_caller_frees_its_own() -> None:
    cache = make_cache()
    original, node = cache_tokens(cache, seq(0, 8))
    free_before = cache.pool.num_free_pages
    mine = cache.pool.alloc(2)
    assert mine is not None
    tree_pages, again = cache.insert(seq(0, 8), mine)
    assert tree_pages == original  # the KV already cached wins
    assert again is node
    assert cache.total_pages == 2  # the duplicates were not adopted
    cache.pool.free([p for p in mine if p not in tree_pages])
    assert cache.pool.num_free_pages == free_before


def test_inserting_a_longer_sequence_adopts_only_the_new_pages() -> None:
    cache = make_cache()
    first, _ = cache_tokens(cache, seq(0, 8))
    mine = cache.pool.alloc(4)
    assert mine is not None
    tree_pages, leaf = cache.insert(seq(0, 16), mine)
    assert tree_pages == first + mine[2:]
    assert leaf.pages == mine[2:] and leaf.key == seq(8, 8)
    assert cache.total_pages == 4


def test_inserting_a_shorter_prefix_splits_and_returns_the_upper_part() -> None:
    cache = make_cache()
    pages, leaf = cache_tokens(cache, seq(0, 12))
    tree_pages, node = cache_tokens(cache, seq(0, 4))
    assert tree_pages == pages[:1]
    assert node.key == seq(0, 4) and leaf.parent is node
    assert cache.total_pages == 3


# --- locking, pinning, eviction ----------------------------------------------------------------


def test_eviction_frees_pages_back_to_the_pool_and_empties_the_tree() -> None:
    cache = make_cache(num_pages=9)
    cache_tokens(cache, seq(0, 16))
    assert cache.pool.num_free_pages == 4 and cache.evictable_pages == 4
    assert cache.evict(1) == 4  # whole nodes go: at least what was asked, here the 4-page leaf
    assert cache.pool.num_free_pages == 8
    assert cache.total_pages == 0 and cache.nodes() == []
    assert cache.match_prefix(seq(0, 16)).length == 0


def test_evict_of_nothing_or_with_nothing_evictable_frees_nothing() -> None:
    cache = make_cache()
    _, node = cache_tokens(cache, seq(0, 8))
    assert cache.evict(0) == 0
    cache.lock(node)
    assert cache.evict(100) == 0
    assert cache.total_pages == 2


def test_a_locked_node_and_its_ancestors_are_never_evicted() -> None:
    cache = make_cache()
    cache_tokens(cache, seq(0, 8))
    _, deep = cache_tokens(cache, seq(0, 16))  # child of the first node
    _, other = cache_tokens(cache, seq(100, 8))
    cache.lock(deep)
    assert cache.protected_pages == 4 and cache.evictable_pages == 2
    assert cache.evict(100) == 2  # only the unlocked branch
    assert other.parent is not None and cache.path_pages(deep) == cache.match_prefix(seq(0, 16)).pages
    assert cache.match_prefix(seq(0, 16), touch=False).length == 16
    assert cache.match_prefix(seq(100, 8), touch=False).length == 0
    cache.unlock(deep)
    assert cache.protected_pages == 0 and cache.evictable_pages == 4
    assert cache.evict(100) == 4
    assert cache.total_pages == 0


def test_a_locked_descendant_keeps_an_unlocked_parent_alive_but_its_sibling_goes() -> None:
    cache = make_cache()
    cache_tokens(cache, seq(0, 8))
    _, a = cache_tokens(cache, seq(0, 8) + seq(200, 4))
    _, b = cache_tokens(cache, seq(0, 8) + seq(300, 4))
    cache.lock(a)
    assert cache.evict(100) == 1  # b; the shared parent is on a's path
    assert cache.match_prefix(seq(0, 8) + seq(200, 4), touch=False).length == 12
    assert cache.match_prefix(seq(0, 8) + seq(300, 4), touch=False).length == 8


def test_pinned_nodes_are_kept_like_locked_ones_until_unpinned() -> None:
    cache = make_cache()
    _, node = cache_tokens(cache, seq(0, 8))
    cache.pin(node)
    assert cache.protected_pages == 2
    assert cache.evict(100) == 0
    cache.lock(node)  # locked and pinned: counted once
    assert cache.protected_pages == 2
    cache.unpin(node)
    assert cache.protected_pages == 2  # still locked
    cache.unlock(node)
    assert cache.protected_pages == 0
    assert cache.evict(100) == 2


def test_unlocking_an_unlocked_node_raises() -> None:
    cache = make_cache()
    _, node = cache_tokens(cache, seq(0, 4))
    with pytest.raises(RuntimeError):
        cache.unlock(node)


def test_unpinning_an_unpinned_node_raises() -> None:
    # A stray unpin must not drive pin_count negative: the accounting would silently drift
    # (a later pin would then protect nothing).
    cache = make_cache()
    _, node = cache_tokens(cache, seq(0, 4))
    with pytest.raises(RuntimeError):
        cache.unpin(node)
    cache.pin(node)
    assert cache.protected_pages == 1
    assert cache.evict(100) == 0


def test_eviction_is_least_recently_used_first_among_unlocked_leaves() -> None:
    cache = make_cache()
    _, a = cache_tokens(cache, seq(0, 4))
    _, b = cache_tokens(cache, seq(100, 4))
    _, c = cache_tokens(cache, seq(200, 4))
    cache.match_prefix(seq(0, 4))  # a is now the most recently used
    evicted: list[list[int]] = []
    cache.on_evict = lambda tokens, pages: evicted.append(tokens)
    assert cache.evict(1) == 1
    assert evicted == [seq(100, 4)]  # b: inserted before c and not touched since
    assert cache.evict(1) == 1
    assert evicted == [seq(100, 4), seq(200, 4)]
    assert cache.match_prefix(seq(0, 4), touch=False).length == 4


def test_eviction_cascades_to_parents_that_become_leaves() -> None:
    cache = make_cache()
    cache_tokens(cache, seq(0, 8))
    cache_tokens(cache, seq(0, 8) + seq(50, 4))
    cache_tokens(cache, seq(0, 8) + seq(60, 4))
    _, lone = cache_tokens(cache, seq(900, 4))
    cache.match_prefix(seq(900, 4))  # the lone leaf is the newest
    evicted: list[list[int]] = []
    cache.on_evict = lambda tokens, pages: evicted.append(tokens)
    # The two children are older than the lone leaf; once both are gone their parent is a
    # leaf (older than the lone one, too) and goes before it.
    assert cache.evict(4) == 4
    assert sorted(map(tuple, evicted[:2])) == [tuple(seq(0, 8) + seq(50, 4)), tuple(seq(0, 8) + seq(60, 4))]
    assert evicted[2] == seq(0, 8)
    assert cache.nodes() == [lone]


def test_the_evict_hook_gets_the_full_token_path_and_the_pages() -> None:
    cache = make_cache()
    cache_tokens(cache, seq(0, 8))
    mine = cache.pool.alloc(3)
    assert mine is not None
    cache.insert(seq(0, 12), mine[:3])
    cache.pool.free(mine[:2])
    seen: list[tuple[list[int], list[int]]] = []
    cache.on_evict = lambda tokens, pages: seen.append((tokens, pages))
    cache.evict(1)
    assert seen == [(seq(0, 12), [mine[2]])]


def test_evicted_pages_go_to_the_hook_and_then_back_to_the_pool() -> None:
    cache = make_cache(num_pages=5)
    cache_tokens(cache, seq(0, 16))
    cache.on_evict = lambda tokens, pages: None
    cache.evict(4)
    assert cache.pool.num_free_pages == 4


def test_a_split_keeps_both_halves_locked_and_the_original_handle_unlocks_them() -> None:
    cache = make_cache()
    _, leaf = cache_tokens(cache, seq(0, 12))
    cache.lock(leaf)
    upper = cache.match_prefix(seq(0, 4)).node
    assert upper is not leaf and upper.lock_ref == 1 and leaf.lock_ref == 1
    assert cache.protected_pages == 3
    assert cache.evict(100) == 0
    cache.unlock(leaf)  # the request still holds the handle it locked: the lower half
    assert upper.lock_ref == 0 and cache.protected_pages == 0
    assert cache.evict(100) == 3


def test_hits_count_matches_along_the_path_but_not_inserts_or_untouched_lookups() -> None:
    cache = make_cache()
    _, short = cache_tokens(cache, seq(0, 4))
    _, long = cache_tokens(cache, seq(0, 12))
    assert (short.hits, long.hits) == (0, 0)  # inserting is not a hit
    cache.match_prefix(seq(0, 12))
    cache.match_prefix(seq(0, 5))
    cache.match_prefix(seq(0, 12), touch=False)
    assert short.hits == 2  # on the path of both touching lookups
    assert long.hits == 1
    # A split copies the count so the upper half still knows how hot it is.
    upper = cache.match_prefix(seq(0, 8), touch=False).node
    assert upper.hits == 1 and upper.parent is short


def test_reset_drops_everything_unprotected() -> None:
    cache = make_cache()
    _, kept = cache_tokens(cache, seq(0, 8))
    cache_tokens(cache, seq(100, 8))
    cache.pin(kept)
    cache.reset()
    assert cache.total_pages == 2 and cache.nodes() == [kept]


# --- property: thousands of random operations ---------------------------------------------------

SMALL_PS = 2
CAPACITY = 24
# Tokens from a tiny alphabet so random sequences share prefixes, split nodes and collide.
# A choice is (node index or -1 for fresh tokens, pages of that node's path to keep, tokens
# to append); lengths are ragged on purpose.
choices = st.tuples(
    st.integers(-1, 50), st.integers(0, 6), st.lists(st.integers(0, 2), min_size=0, max_size=4 * SMALL_PS)
)


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(CAPACITY + 1, SMALL_PS)
        self.cache = RadixCache(self.pool, on_evict=self._on_evict)
        self.locks: list[RadixNode] = []  # one entry per lock() the test holds
        self.pins: list[RadixNode] = []
        self.private: list[list[int]] = []  # pages the test holds outside the tree
        self.evicted_pages: list[int] = []

    def _on_evict(self, tokens: list[int], pages: list[int]) -> None:
        assert len(tokens) % SMALL_PS == 0 and len(pages) >= 1
        self.evicted_pages.extend(pages)

    def _attached(self, node: RadixNode) -> bool:
        while node is not self.cache.root:
            parent = node.parent
            if parent is None or node not in parent.children.values():
                return False
            node = parent
        return True

    def _tokens(self, choice: tuple[int, int, list[int]]) -> list[int]:
        """Random tokens, or (most often) part of a cached path plus random tokens: that is
        what makes lookups end inside locked and pinned nodes and split them."""
        i, keep_pages, extra = choice
        nodes = self.cache.nodes()
        if i < 0 or not nodes:
            return extra
        path = self.cache.path_tokens(nodes[i % len(nodes)])
        return (path[: keep_pages * SMALL_PS] + extra)[: 8 * SMALL_PS]

    @rule(choice=choices)
    def insert(self, choice: tuple[int, int, list[int]]) -> None:
        tokens = self._tokens(choice)
        tokens = tokens[: len(tokens) - len(tokens) % SMALL_PS]
        n = len(tokens) // SMALL_PS
        if n == 0:
            return
        own = self.pool.alloc(n)
        if own is None:
            self.cache.evict(n - self.pool.num_free_pages)
            own = self.pool.alloc(n)
        if own is None:
            return  # everything is locked, pinned or private: a real caller would preempt
        before = self.cache.match_prefix(tokens, touch=False)
        tree_pages, node = self.cache.insert(tokens, own)
        assert len(tree_pages) == n
        assert tree_pages[: len(before.pages)] == before.pages  # the cached part is the tree's
        assert tree_pages[len(before.pages) :] == own[len(before.pages) :]  # the rest adopted
        assert self.cache.path_tokens(node) == tokens and self.cache.path_pages(node) == tree_pages
        self.pool.free([p for p in own if p not in tree_pages])

    @rule(choice=choices)
    def match_and_lock(self, choice: tuple[int, int, list[int]]) -> None:
        tokens = self._tokens(choice)  # ragged lengths: partial last pages must not match
        m = self.cache.match_prefix(tokens)
        assert m.length % SMALL_PS == 0 and m.length <= len(tokens)
        assert len(m.pages) * SMALL_PS == m.length
        assert self.cache.path_tokens(m.node) == tokens[: m.length]
        assert self.cache.path_pages(m.node) == m.pages
        # Longest: the next page (if whole) is not a child of the matched node.
        nxt = tuple(tokens[m.length : m.length + SMALL_PS])
        assert len(nxt) < SMALL_PS or all(
            tuple(c.key[:SMALL_PS]) != nxt for c in m.node.children.values()
        )
        if m.node is not self.cache.root:
            self.cache.lock(m.node)
            self.locks.append(m.node)

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 10**6))
    def unlock(self, i: int) -> None:
        self.cache.unlock(self.locks.pop(i % len(self.locks)))

    @rule(choice=choices)
    def pin(self, choice: tuple[int, int, list[int]]) -> None:
        m = self.cache.match_prefix(self._tokens(choice), touch=False)
        if m.node is not self.cache.root:
            self.cache.pin(m.node)
            self.pins.append(m.node)

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 10**6))
    def unpin(self, i: int) -> None:
        self.cache.unpin(self.pins.pop(i % len(self.pins)))

    @rule(n=st.integers(0, CAPACITY + 2))
    def evict(self, n: int) -> None:
        evictable, free = self.cache.evictable_pages, self.pool.num_free_pages
        self.evicted_pages = []
        freed = self.cache.evict(n)
        assert freed == len(self.evicted_pages)
        assert freed <= evictable
        assert freed >= min(n, evictable)  # at least what was asked when that much is evictable
        assert self.pool.num_free_pages == free + freed
        for held in self.locks + self.pins:
            assert self._attached(held), "a locked or pinned node was evicted"

    @rule(n=st.integers(1, 4))
    def hold_private(self, n: int) -> None:
        pages = self.pool.alloc(n)
        if pages is not None:
            self.private.append(pages)

    @precondition(lambda self: self.private)
    @rule()
    def release_private(self) -> None:
        self.pool.free(self.private.pop())

    @invariant()
    def accounting_is_exact(self) -> None:
        cache = self.cache
        nodes = cache.nodes()
        tree_pages = [p for n in nodes for p in n.pages]
        private = [p for ps in self.private for p in ps]
        assert len(tree_pages) == len(set(tree_pages)), "a page is in two nodes"
        assert not set(tree_pages) & set(private)
        assert not set(tree_pages) & set(self.pool._free) and not set(private) & set(self.pool._free)
        assert cache.total_pages == len(tree_pages)
        assert self.pool.num_free_pages + len(tree_pages) + len(private) == CAPACITY, "page leak"

        # Lock/pin counts are exactly the handles the test holds, summed along their paths.
        want_locks: Counter[int] = Counter()
        want_pins: Counter[int] = Counter()
        for handles, want in ((self.locks, want_locks), (self.pins, want_pins)):
            for h in handles:
                assert self._attached(h)
                while h is not cache.root:
                    want[id(h)] += 1
                    h = h.parent  # type: ignore[assignment]
        for n in nodes:
            assert n.lock_ref == want_locks[id(n)] and n.pin_count == want_pins[id(n)]
        protected = sum(len(n.pages) for n in nodes if n.lock_ref > 0 or n.pin_count > 0)
        assert cache.protected_pages == protected
        assert cache.evictable_pages == len(tree_pages) - protected

        # Shape: whole pages, children keyed by their first page, parents linked back.
        for n in nodes:
            assert len(n.pages) >= 1 and len(n.key) == len(n.pages) * SMALL_PS
            assert n.parent is not None and n.parent.children[tuple(n.key[:SMALL_PS])] is n
            assert len(cache.path_tokens(n)) == len(cache.path_pages(n)) * SMALL_PS
            # Every cached path is found again, whole, by a lookup.
            m = cache.match_prefix(cache.path_tokens(n), touch=False)
            assert m.length == len(cache.path_tokens(n)) and m.node is n


RadixMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_radix_random_operations = RadixMachine.TestCase
