"""Extend attention for the torch backend: the extending sequences of a step in a few
padded calls instead of one call per sequence.

The reference attends sequence by sequence, paying about a dozen small tensor ops (slot
index, gathers, mask, SDPA, copy back) per sequence per layer; when a new conversation turn
arrives for many conversations at once that loop, not the arithmetic, dominated the step
on CPU. Here sequences are sorted by how many new tokens they bring and cut into a few
groups of similar length; within a group the new tokens are padded to the longest, the keys
to the longest prompt, and one SDPA call with a causal-with-offset mask does the group.
The bookkeeping (slots, masks, padding and reordering indices) is worked out once per
forward pass by `plan_extend` and shared by every layer.

Padding costs arithmetic, so the plan is only used while the padded work stays within a
bound of the real work and memory; otherwise the reference runs (see `worth_batching`).
reference.py stays the ground truth this is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from preheat.engine.kernels.kv_fp8 import load
from preheat.engine.kernels.reference import slot_index

# A group may pad its query x key pairs up to this factor before a new group (one more SDPA
# call per layer) is cheaper...
GROUP_SLACK = 1.3
MAX_GROUPS = 4
# ...and the whole batch may pad up to this factor before the per-sequence loop is used.
MAX_PADDING_FACTOR = 2.0
# A group's mask is materialised (SDPA's scores are not): at most this many elements.
MAX_MASK_ELEMENTS = 32 * 2**20


def _work(seqs: list[int], prefix_lens: list[int], extend_lens: list[int]) -> tuple[int, int]:
    """(real, padded) query x key pairs of one group."""
    totals = [prefix_lens[i] + extend_lens[i] for i in seqs]
    real = sum(extend_lens[i] * t for i, t in zip(seqs, totals))
    return real, len(seqs) * max(extend_lens[i] for i in seqs) * max(totals)


def group_by_length(prefix_lens: list[int], extend_lens: list[int]) -> list[list[int]]:
    """Pure: sequence indices cut into at most MAX_GROUPS groups of similar extend length."""
    order = sorted(range(len(extend_lens)), key=lambda i: (extend_lens[i], prefix_lens[i]))
    groups = [[order[0]]]
    for i in order[1:]:
        grown = groups[-1] + [i]
        real, padded = _work(grown, prefix_lens, extend_lens)
        if padded <= GROUP_SLACK * real or len(groups) == MAX_GROUPS:
            groups[-1] = grown
        else:
            groups.append([i])
    return groups


def groups_worth_batching(prefix_lens: list[int], extend_lens: list[int]) -> list[list[int]] | None:
    """Pure: the groups, when the grouped, padded batch beats the per-sequence loop."""
    if len(extend_lens) < 2:
        return None  # nothing to batch; the reference needs no mask at all
    groups = group_by_length(prefix_lens, extend_lens)
    real = padded = 0
    for group in groups:
        r, p = _work(group, prefix_lens, extend_lens)
        if p > MAX_MASK_ELEMENTS:
            return None
        real, padded = real + r, padded + p
    return groups if padded <= MAX_PADDING_FACTOR * real else None


def worth_batching(prefix_lens: list[int], extend_lens: list[int]) -> bool:
    return groups_worth_batching(prefix_lens, extend_lens) is not None


@dataclass
class ExtendGroup:
    """S sequences' new tokens padded to E rows each, attending to their first L keys."""

    num_seqs: int  # S
    rows: int  # E
    keys: int  # L
    slots: torch.Tensor  # int64 [S * L]: each sequence's key slots, padded
    mask: torch.Tensor  # bool [S, 1, E, L]: True where a query sees a key
    pad_index: torch.Tensor  # int64 [S * E]: flat row of q feeding each padded row (0 for padding)
    unpad_index: torch.Tensor  # int64 [T_group]: padded row holding each of the group's rows


@dataclass
class ExtendPlan:
    groups: list[ExtendGroup]
    order: torch.Tensor | None  # int64 [T]: row of the groups' concatenated output holding each flat row


def _plan_group(
    page_table: torch.Tensor, seqs: list[int], starts: list[int], prefix_lens: list[int],
    extend_lens: list[int], page_size: int,
) -> ExtendGroup:
    dev = page_table.device
    prefixes = [prefix_lens[i] for i in seqs]
    extends = [extend_lens[i] for i in seqs]
    keys = max(p + e for p, e in zip(prefixes, extends))
    rows = max(extends)
    table = page_table[torch.tensor(seqs, device=dev), : -(-keys // page_size)]
    slots = slot_index(table, page_size)[:, :keys]
    t = torch.arange(rows, device=dev)
    # Query t of a sequence sits at position prefix + t and sees keys 0..prefix + t.
    query_pos = torch.tensor(prefixes, device=dev).unsqueeze(1) + t
    mask = torch.arange(keys, device=dev)[None, None, :] <= query_pos[:, :, None]
    real = t[None, :] < torch.tensor(extends, device=dev)[:, None]  # [S, E]
    first_row = torch.tensor([starts[i] for i in seqs], device=dev)
    return ExtendGroup(
        num_seqs=len(seqs),
        rows=rows,
        keys=keys,
        slots=slots.reshape(-1),
        mask=mask.unsqueeze(1),
        pad_index=torch.where(real, first_row[:, None] + t[None, :], 0).reshape(-1),
        unpad_index=(torch.arange(len(seqs), device=dev)[:, None] * rows + t[None, :])[real],
    )


def plan_extend(
    page_table: torch.Tensor, prefix_lens: list[int], extend_lens: list[int], page_size: int,
    groups: list[list[int]] | None = None,
) -> ExtendPlan:
    starts = [0]
    for e in extend_lens[:-1]:
        starts.append(starts[-1] + e)
    groups = groups or group_by_length(prefix_lens, extend_lens)
    plans = [_plan_group(page_table, g, starts, prefix_lens, extend_lens, page_size) for g in groups]
    # Flat rows in the order the groups emit them; `order` inverts that.
    emitted = [r for g in groups for i in g for r in range(starts[i], starts[i] + extend_lens[i])]
    if emitted == list(range(len(emitted))):
        return ExtendPlan(plans, None)
    order = torch.empty(len(emitted), dtype=torch.int64)
    order[torch.tensor(emitted)] = torch.arange(len(emitted))
    return ExtendPlan(plans, order.to(page_table.device))


def _attend_group(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: ExtendGroup, scale: float
) -> torch.Tensor:
    num_heads, hd = q.shape[1:]
    kvh = k_cache.shape[2]
    s, rows, keys = g.num_seqs, g.rows, g.keys
    queries = q.index_select(0, g.pad_index).view(s, rows, num_heads, hd).transpose(1, 2)
    k = load(k_cache.view(-1, kvh, hd).index_select(0, g.slots).view(s, keys, kvh, hd), k_cache, q.dtype).transpose(1, 2)
    v = load(v_cache.view(-1, kvh, hd).index_select(0, g.slots).view(s, keys, kvh, hd), v_cache, q.dtype).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        queries, k, v, attn_mask=g.mask, scale=scale, enable_gqa=num_heads != kvh
    )  # [S, H, E, hd]
    return out.transpose(1, 2).reshape(s * rows, num_heads, hd).index_select(0, g.unpad_index)


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: ExtendPlan, scale: float
) -> torch.Tensor:
    """New tokens of several sequences back to back: q [T, H, hd] -> [T, H, hd]; their own
    K/V are already in the pool."""
    outs = [_attend_group(q, k_cache, v_cache, g, scale) for g in plan.groups]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out if plan.order is None else out.index_select(0, plan.order)
