"""PyTorch reference attention over the paged KV pool: the CPU path and the ground truth
that the Triton kernels are tested against.

Layouts are fixed in docs/engine-internals.md: a cache is [num_pages, page_size, kvh, hd]
and a token's slot is `page * page_size + offset`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from preheat.engine.kernels.kv_fp8 import load, store


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Stores new keys/values [T, kvh, hd] at their slots (int64 [T])."""
    kvh, hd = k_cache.shape[-2:]
    # index_copy_ has no fp8 kernel on CPU: an fp8 cache is written through its bytes.
    kf, vf = k_cache.view(-1, kvh, hd), v_cache.view(-1, kvh, hd)
    ks, vs = store(k, k_cache), store(v, v_cache)
    if ks.element_size() == 1 and ks.is_floating_point() and ks.device.type == "cpu":
        kf, vf, ks, vs = kf.view(torch.uint8), vf.view(torch.uint8), ks.view(torch.uint8), vs.view(torch.uint8)
    kf.index_copy_(0, slots, ks)
    vf.index_copy_(0, slots, vs)


def slot_index(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """[..., n] page ids -> [..., n * page_size] slot ids in token order."""
    offsets = torch.arange(page_size, device=pages.device, dtype=torch.int64)
    return (pages.to(torch.int64).unsqueeze(-1) * page_size + offsets).flatten(-2)


class DecodeGather:
    """Which pool slots a decode batch reads, and which of them are real. Every layer reads
    the same slots, so the forward pass computes this once, not once per layer."""

    def __init__(self, page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> None:
        self.max_len = int(seq_lens.max())
        pages_needed = (self.max_len + page_size - 1) // page_size
        self.slots = slot_index(page_table[:, :pages_needed], page_size)[:, : self.max_len].reshape(-1)
        valid = torch.arange(self.max_len, device=page_table.device) < seq_lens.to(page_table.device).unsqueeze(1)
        self.mask = valid[:, None, None, :]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    gather: DecodeGather | None = None,
) -> torch.Tensor:
    """One query token per sequence. q [B, H, hd] -> [B, H, hd]."""
    batch, num_heads, hd = q.shape
    page_size, kvh = k_cache.shape[1], k_cache.shape[2]
    gather = gather or DecodeGather(page_table, seq_lens, page_size)
    max_len, slots = gather.max_len, gather.slots
    # index_select on a flat view is several times faster than advanced indexing on CPU.
    keys = load(k_cache.view(-1, kvh, hd).index_select(0, slots).view(batch, max_len, kvh, hd), k_cache, q.dtype)
    values = load(v_cache.view(-1, kvh, hd).index_select(0, slots).view(batch, max_len, kvh, hd), v_cache, q.dtype)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, H, 1, hd]
        keys.transpose(1, 2),  # [B, kvh, L, hd]
        values.transpose(1, 2),
        attn_mask=gather.mask,
        scale=scale,
        enable_gqa=num_heads != kvh,
    )
    return out.squeeze(2)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: list[int] | torch.Tensor,
    extend_lens: list[int] | torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """New tokens of several sequences back to back, each attending to its cached prefix
    and causally to its own new tokens (whose K/V are already in the pool)."""
    num_heads, hd = q.shape[1:]
    page_size, kvh = k_cache.shape[1], k_cache.shape[2]
    prefix_lens = [int(x) for x in prefix_lens]
    extend_lens = [int(x) for x in extend_lens]
    out = torch.empty_like(q)
    k_flat = k_cache.view(-1, kvh, hd)
    v_flat = v_cache.view(-1, kvh, hd)
    start = 0
    for i, (prefix, extend) in enumerate(zip(prefix_lens, extend_lens)):
        total = prefix + extend
        pages = (total + page_size - 1) // page_size
        slots = slot_index(page_table[i : i + 1, :pages], page_size)[0, :total]
        keys = load(k_flat.index_select(0, slots), k_cache, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, kvh, total, hd]
        values = load(v_flat.index_select(0, slots), v_cache, q.dtype).transpose(0, 1).unsqueeze(0)
        queries = q[start : start + extend].transpose(0, 1).unsqueeze(0)  # [1, H, extend, hd]
        if prefix == 0:
            mask = None
        else:
            # Query j sits at absolute position prefix + j and sees keys 0..prefix + j.
            key_pos = torch.arange(total, device=q.device)
            query_pos = torch.arange(extend, device=q.device) + prefix
            mask = key_pos[None, :] <= query_pos[:, None]
        o = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=mask,
            is_causal=prefix == 0,
            scale=scale,
            enable_gqa=num_heads != kvh,
        )
        out[start : start + extend] = o[0].transpose(0, 1)
        start += extend
    return out
