"""Moving cached prefixes between the KV pool / radix tree and the outside: snapshot export
and restore, and the L2/L3 tiers' offload and bring-back of single pages.

Runs on the engine's stepping thread (the pool and tree are not thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from preheat.engine.kv.pool import KVPool
from preheat.engine.kv.radix import RadixCache, RadixNode
from preheat.engine.kv.snapshot import PrefixRecord


def read_pages(pool: KVPool, pages: list[int]) -> torch.Tensor:
    """KV of whole pages as [num_layers, 2, len(pages) * page_size, kvh, hd] on the CPU, every
    KV head (under tensor parallelism the pool gathers them from the ranks)."""
    return pool.read_pages(pages)


def write_pages(pool: KVPool, pages: list[int], kv: torch.Tensor) -> None:
    """Inverse of read_pages (under tensor parallelism each rank gets its heads)."""
    pool.write_pages(pages, kv)


def export_prefixes(pool: KVPool, radix: RadixCache, max_tokens: int | None) -> list[PrefixRecord]:
    """The hottest cached prefixes: every pinned prefix first, then whole root-to-leaf paths
    by hits x recency, within max_tokens of stored KV. A path that extends one already
    exported stores only its new tokens (kv_start), so a shared prefix is written once and
    always before what extends it."""
    pinned = [n for n in radix.nodes() if n.pin_count > 0 and not any(c.pin_count > 0 for c in n.children.values())]
    leaves = [n for n in radix.nodes() if n.is_leaf and n.pin_count == 0]
    leaves.sort(key=lambda n: n.last_access, reverse=True)
    # hits x recency: the most recently used leaf weighs 1, the least 1/len.
    recency = {id(n): 1.0 / (rank + 1) for rank, n in enumerate(leaves)}
    leaves.sort(key=lambda n: (n.hits + 1) * recency[id(n)], reverse=True)  # stable: recency breaks ties
    exported: dict[int, int] = {}  # id(node) -> tokens up to and including it
    records: list[PrefixRecord] = []
    used = 0
    for node, is_pinned in [(n, True) for n in pinned] + [(n, False) for n in leaves]:
        path = radix.path_nodes(node)
        covered = 0
        for ancestor in path:
            if id(ancestor) in exported:
                covered = exported[id(ancestor)]
        tokens = radix.path_tokens(node)
        if covered == len(tokens):
            continue
        if max_tokens is not None and used + len(tokens) - covered > max_tokens:
            continue
        pages = radix.path_pages(node)[covered // pool.page_size :]
        records.append(PrefixRecord(tokens, read_pages(pool, pages), node.hits, is_pinned, covered))
        used += len(tokens) - covered
        length = 0
        for ancestor in path:
            length += len(ancestor.key)
            exported[id(ancestor)] = length
    return records


def import_prefix(
    pool: KVPool,
    radix: RadixCache,
    token_ids: list[int],
    kv_for: Callable[[int, int], torch.Tensor],
    alloc: Callable[[int], list[int] | None],
) -> RadixNode | None:
    """Puts a prefix into the tree. `kv_for(start, end)` gives the KV of tokens [start, end)
    (whole pages) and is only called for the part not already cached. Returns the node the
    prefix ends at, or None when the pool has no room."""
    match = radix.match_prefix(token_ids, touch=False)
    if match.length == len(token_ids):
        return match.node
    radix.lock(match.node)  # the allocation below may evict; not this
    try:
        pages = alloc((len(token_ids) - match.length) // pool.page_size)
        if pages is None:
            return None
        write_pages(pool, pages, kv_for(match.length, len(token_ids)))
        tree_pages, node = radix.insert(token_ids, match.pages + pages)
    finally:
        radix.unlock(match.node)
    duplicates = [p for p, q in zip(match.pages + pages, tree_pages) if p != q]
    if duplicates:
        pool.free(duplicates)
    return node
