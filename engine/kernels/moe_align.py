"""Groups a batch's (token, expert) pairs into fixed-size blocks of one expert each — the
layout a grouped GEMM runs on (engine/kernels/triton_moe.py) — with torch ops only and no
host sync, so it can sit inside a captured CUDA graph.

For `topk_ids` [T, k], pair p = t * k + j means "token t's j-th expert". Each expert's pairs
are laid out contiguously, padded up to a multiple of `block_m` with the sentinel T * k, so
every block of `block_m` entries belongs to exactly one expert. Output sizes depend only on
T, k, E and block_m (never on the routing): the worst case, where every non-empty expert
wastes block_m - 1 entries, bounds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockLayout:
    sorted_ids: torch.Tensor  # int32 [max_blocks * block_m]: pair index, or T*k for padding
    block_expert: torch.Tensor  # int32 [max_blocks]: the expert of each block (E past the end)
    num_padded: torch.Tensor  # int32 [1]: entries in use (a multiple of block_m); blocks past it are idle
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_padded_entries(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded entries, rounded to whole blocks: at most min(E, pairs)
    experts are non-empty and each wastes at most block_m - 1 entries."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockLayout:
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.shape[0]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without its host sync
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in pair order within one
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=device) - count_start[expert_of]
    total = max_padded_entries(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((total,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[padded_start[expert_of] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, total, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return BlockLayout(sorted_ids, block_expert, padded_end[-1:].to(torch.int32), block_m)
