"""Radix tree over token ids whose nodes own KV pages (page-granular prefix cache).

Every key is a whole number of pages. A node's pages hold the KV of its key's tokens, at
the positions its path from the root implies. Requests lock the node their prefix ends at
(and so the whole path); locked and pinned nodes are never evicted. Eviction removes the
least recently used unlocked leaves and frees (or hands to `on_evict`) their pages.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from preheat.engine.kv.pool import KVPool

_clock = itertools.count(1)


class RadixNode:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "hits", "pin_count")

    def __init__(self, key: list[int], pages: list[int], parent: RadixNode | None) -> None:
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = next(_clock)
        self.hits = 0
        self.pin_count = 0

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass
class MatchResult:
    pages: list[int]
    node: RadixNode
    length: int  # tokens matched, a multiple of the page size


EvictHook = Callable[[list[int], list[int]], None]  # (full token path of the node, its pages)


class RadixCache:
    def __init__(self, pool: KVPool, on_evict: EvictHook | None = None) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.root = RadixNode([], [], None)
        self.root.lock_ref = 1  # the root is never evicted
        self.on_evict = on_evict
        self.total_pages = 0
        self.protected_pages = 0  # pages in locked or pinned nodes

    # --- lookups -------------------------------------------------------------------
    def _page_key(self, tokens: list[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def match_prefix(self, tokens: list[int], touch: bool = True) -> MatchResult:
        """Longest cached page-aligned prefix of `tokens`. Splits a node when the match ends
        inside it so the returned node covers exactly the match."""
        ps = self.page_size
        usable = len(tokens) - len(tokens) % ps
        node, pos, pages = self.root, 0, []
        stamp = next(_clock)
        while pos < usable:
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos, usable)
            if n < len(child.pages):
                child = self._split(child, n)
            pages.extend(child.pages)
            pos += n * ps
            node = child
            if touch:
                node.last_access = stamp
        if touch:
            n = node
            while n is not self.root:
                n.hits += 1
                n = n.parent  # type: ignore[assignment]
        return MatchResult(pages, node, pos)

    def _common_pages(self, key: list[int], tokens: list[int], pos: int, usable: int) -> int:
        ps = self.page_size
        limit = min(len(key), usable - pos) // ps
        if key[: limit * ps] == tokens[pos : pos + limit * ps]:
            return limit
        n = 1  # the first page matched through the children dict
        while n < limit and key[n * ps : (n + 1) * ps] == tokens[pos + n * ps : pos + (n + 1) * ps]:
            n += 1
        return n

    def _split(self, node: RadixNode, n_pages: int) -> RadixNode:
        """Cuts `node` after n_pages; returns the new upper part."""
        cut = n_pages * self.page_size
        parent = node.parent
        assert parent is not None
        upper = RadixNode(node.key[:cut], node.pages[:n_pages], parent)
        upper.lock_ref = node.lock_ref
        upper.pin_count = node.pin_count
        upper.last_access = node.last_access
        upper.hits = node.hits
        parent.children[self._page_key(node.key, 0)] = upper
        node.key = node.key[cut:]
        node.pages = node.pages[n_pages:]
        node.parent = upper
        upper.children[self._page_key(node.key, 0)] = node
        return upper

    # --- insertion -----------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int]) -> tuple[list[int], RadixNode]:
        """Caches pages for the page-aligned `tokens`. Returns the tree's pages for the whole
        range (the caller frees any of its own pages that differ: those were duplicates of
        KV already cached) and the node the range ends at."""
        ps = self.page_size
        if len(tokens) % ps or len(tokens) // ps != len(pages):
            raise ValueError("insert needs whole pages and one page id per page")
        match = self.match_prefix(tokens, touch=False)
        node, pos = match.node, match.length
        if pos < len(tokens):
            new = RadixNode(list(tokens[pos:]), list(pages[pos // ps :]), node)
            node.children[self._page_key(new.key, 0)] = new
            self.total_pages += len(new.pages)
            node = new
        node.last_access = next(_clock)
        return match.pages + list(pages[pos // ps :]), node

    # --- locking and pinning -------------------------------------------------------
    # A lock is held by a running request, a pin by a warm-start prefix; either keeps the
    # node and every ancestor from eviction. Both walk the path the same way.
    def lock(self, node: RadixNode) -> None:
        self._hold(node, locks=1, pins=0)

    def unlock(self, node: RadixNode) -> None:
        self._hold(node, locks=-1, pins=0)

    def pin(self, node: RadixNode) -> None:
        """Keeps a prefix (and its path) from eviction until unpinned."""
        self._hold(node, locks=0, pins=1)

    def unpin(self, node: RadixNode) -> None:
        self._hold(node, locks=0, pins=-1)

    def _path(self, node: RadixNode) -> list[RadixNode]:
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        return path

    def _hold(self, node: RadixNode, locks: int, pins: int) -> None:
        path = self._path(node)
        # Check the whole path before changing any of it: a bad release changes nothing.
        if any(n.lock_ref + locks < 0 for n in path):
            raise RuntimeError("unlock of an unlocked radix node")
        if any(n.pin_count + pins < 0 for n in path):
            raise RuntimeError("unpin of an unpinned radix node")
        for n in path:
            was = n.lock_ref > 0 or n.pin_count > 0
            n.lock_ref += locks
            n.pin_count += pins
            now = n.lock_ref > 0 or n.pin_count > 0
            if now != was:
                self.protected_pages += len(n.pages) if now else -len(n.pages)

    # --- eviction ------------------------------------------------------------------
    @property
    def evictable_pages(self) -> int:
        return self.total_pages - self.protected_pages

    def evict(self, num_pages: int) -> int:
        """Frees at least num_pages pages if that many are evictable; returns pages freed."""
        if num_pages <= 0:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._nodes() if n.is_leaf and self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            if self.on_evict is not None:
                self.on_evict(self.path_tokens(leaf), list(leaf.pages))
            self.pool.free(leaf.pages)
            freed += len(leaf.pages)
            self.total_pages -= len(leaf.pages)
            del parent.children[self._page_key(leaf.key, 0)]
            if parent is not self.root and parent.is_leaf and self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    @staticmethod
    def _evictable(node: RadixNode) -> bool:
        return node.lock_ref == 0 and node.pin_count == 0

    def reset(self) -> None:
        """Drops every unlocked, unpinned node (used when the cache is flushed)."""
        self.evict(self.total_pages)

    # --- inspection ----------------------------------------------------------------
    def _nodes(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def nodes(self) -> list[RadixNode]:
        return list(self._nodes())

    def path_nodes(self, node: RadixNode) -> list[RadixNode]:
        """Root's child first, `node` last."""
        return list(reversed(self._path(node)))

    def path_tokens(self, node: RadixNode) -> list[int]:
        parts: list[list[int]] = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent  # type: ignore[assignment]
        return [t for part in reversed(parts) for t in part]

    def path_pages(self, node: RadixNode) -> list[int]:
        parts: list[list[int]] = []
        while node is not self.root:
            parts.append(node.pages)
            node = node.parent  # type: ignore[assignment]
        return [p for part in reversed(parts) for p in part]
