"""Extend attention for the torch backend: every extending sequence of a step in one call.

The reference attends sequence by sequence, paying about a dozen small tensor ops (slot
index, gathers, mask, SDPA, copy back) per sequence per layer; when a new conversation turn
arrives for many conversations at once that loop, not the arithmetic, dominated the step
on CPU. Here the new tokens are padded to the longest extend, each sequence's keys to the
longest prompt, and one SDPA call with a causal-with-offset mask does the whole batch. The
bookkeeping (slots, mask, padding indices) is worked out once per forward pass by
`plan_extend` and shared by every layer.

Padding costs arithmetic, so the plan is only used while the padded work stays within a
bound of the real work and memory; otherwise the reference runs (see `worth_batching`).
reference.py stays the ground truth this is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Padded query x key pairs may be at most this many times the real ones...
MAX_PADDING_FACTOR = 2.0
# ...and the mask at most this many elements (it is materialised, unlike SDPA's scores).
MAX_MASK_ELEMENTS = 32 * 2**20


def slot_index(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """[..., n] page ids -> [..., n * page_size] slot ids in token order."""
    offsets = torch.arange(page_size, device=pages.device, dtype=torch.int64)
    return (pages.to(torch.int64).unsqueeze(-1) * page_size + offsets).flatten(-2)


@dataclass
class ExtendPlan:
    """S sequences' new tokens padded to E rows each, attending to their first L keys."""

    num_seqs: int  # S
    rows: int  # E
    keys: int  # L
    slots: torch.Tensor  # int64 [S * L]: each sequence's key slots, padded
    mask: torch.Tensor  # bool [S, 1, E, L]: True where a query sees a key
    pad_index: torch.Tensor  # int64 [S * E]: flat row feeding each padded row (0 for padding)
    unpad_index: torch.Tensor  # int64 [T]: padded row holding each flat row


def worth_batching(prefix_lens: list[int], extend_lens: list[int]) -> bool:
    """Pure: whether padding the batch wastes little enough to beat the per-sequence loop."""
    if len(extend_lens) < 2:
        return False  # nothing to batch; the reference needs no mask at all
    totals = [p + e for p, e in zip(prefix_lens, extend_lens)]
    real = sum(e * t for e, t in zip(extend_lens, totals))
    padded = len(extend_lens) * max(extend_lens) * max(totals)
    return padded <= MAX_PADDING_FACTOR * real and padded <= MAX_MASK_ELEMENTS


def plan_extend(page_table: torch.Tensor, prefix_lens: list[int], extend_lens: list[int], page_size: int) -> ExtendPlan:
    dev = page_table.device
    s = len(extend_lens)
    totals = [p + e for p, e in zip(prefix_lens, extend_lens)]
    keys, rows = max(totals), max(extend_lens)
    pages = -(-keys // page_size)
    slots = slot_index(page_table[:, :pages], page_size)[:, :keys]
    t = torch.arange(rows, device=dev)
    # Query t of sequence i sits at position prefix_i + t and sees keys 0..prefix_i + t.
    query_pos = torch.tensor(prefix_lens, device=dev).unsqueeze(1) + t
    mask = torch.arange(keys, device=dev)[None, None, :] <= query_pos[:, :, None]
    starts = torch.tensor([0] + extend_lens[:-1], device=dev).cumsum(0)
    real = t[None, :] < torch.tensor(extend_lens, device=dev)[:, None]  # [S, E]
    return ExtendPlan(
        num_seqs=s,
        rows=rows,
        keys=keys,
        slots=slots.reshape(-1),
        mask=mask.unsqueeze(1),
        pad_index=torch.where(real, starts[:, None] + t[None, :], 0).reshape(-1),
        unpad_index=(torch.arange(s, device=dev)[:, None] * rows + t[None, :])[real],
    )


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: ExtendPlan, scale: float
) -> torch.Tensor:
    """New tokens of several sequences back to back: q [T, H, hd] -> [T, H, hd]; their own
    K/V are already in the pool."""
    num_heads, hd = q.shape[1:]
    kvh = k_cache.shape[2]
    s, rows, keys = plan.num_seqs, plan.rows, plan.keys
    queries = q.index_select(0, plan.pad_index).view(s, rows, num_heads, hd).transpose(1, 2)
    k = k_cache.view(-1, kvh, hd).index_select(0, plan.slots).view(s, keys, kvh, hd).to(q.dtype).transpose(1, 2)
    v = v_cache.view(-1, kvh, hd).index_select(0, plan.slots).view(s, keys, kvh, hd).to(q.dtype).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        queries, k, v, attn_mask=plan.mask, scale=scale, enable_gqa=num_heads != kvh
    )  # [S, H, E, hd]
    return out.transpose(1, 2).reshape(s * rows, num_heads, hd).index_select(0, plan.unpad_index)
