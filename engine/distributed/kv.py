"""The KV pool under tensor parallelism: sharded by KV head, one page table for all ranks.

Every rank allocates the same number of pages, holding only its KV heads, and rank 0's
allocator is the only one: the page ids a step uses are the same on every rank, so the
workers need no bookkeeping of their own. Reading whole pages out (a snapshot, an offload
to the L2/L3 tiers) gathers every rank's heads to rank 0 and joins them into the full
[layers, 2, tokens, kv_heads, head_dim] layout a single-rank engine has; writing pages back
splits that layout by head. So snapshots and tier pages hold every KV head whatever the
sharding, and a snapshot taken at one tensor-parallel size restores at any other: the
split on restore reshards it.
"""

from __future__ import annotations

from typing import Any

import torch

from preheat.engine.distributed.messages import Op, encode_values
from preheat.engine.distributed.sharding import head_split, kv_head_sources
from preheat.engine.kv.pool import KVPool


def join_heads(parts: list[torch.Tensor], num_kv_heads: int) -> torch.Tensor:
    """Pure: rank r's KV [..., local_heads, hd] (one per rank, in rank order) as the full
    [..., num_kv_heads, hd]; a head replicated on several ranks is taken from the first."""
    sources = kv_head_sources(num_kv_heads, len(parts))
    return torch.stack([parts[rank][..., i, :] for rank, i in sources], dim=-2)


def split_heads(full: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Pure: the full [..., num_kv_heads, hd] KV cut into each rank's heads (inverse of
    join_heads)."""
    kvh = full.shape[-2]
    out = []
    for rank in range(size):
        s = head_split(kvh, kvh, size, rank)
        out.append(full[..., s.kv_start : s.kv_start + s.kv_count, :])
    return out


class ShardedKVPool(KVPool):
    """Rank 0's pool: its own heads locally, every head when pages are read or written."""

    def __init__(self, comm: Any, num_kv_heads: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.comm = comm  # the launcher's driver: serialises with the forward pass
        self.total_kv_heads = num_kv_heads

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        with self.comm.exclusive():
            self.comm.send(Op.READ_PAGES, encode_values([list(pages)]))
            parts = self.comm.gather_to_rank0(super().read_pages(pages))
        assert parts is not None
        return join_heads(parts, self.total_kv_heads)

    def write_pages(self, pages: list[int], kv: torch.Tensor) -> None:
        parts = [p.to(self.dtype) for p in split_heads(kv.to("cpu"), self.comm.size)]
        with self.comm.exclusive():
            self.comm.send(Op.WRITE_PAGES, encode_values([list(pages)]))
            mine = self.comm.scatter_from_rank0(parts, parts[0])
        super().write_pages(pages, mine)
