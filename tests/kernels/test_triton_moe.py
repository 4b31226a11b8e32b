"""The experts' grouped GEMM: the block layout it runs on (pure torch, checked exhaustively on
its invariants) and the Triton kernel against the torch grouped path (float32; on CPU under
the Triton interpreter)."""

from __future__ import annotations

import pytest
import torch
from _kernels import DEVICE, triton_moe

from preheat.engine.kernels.moe_align import align_to_blocks, max_padded_entries
from preheat.engine.model.moe import grouped_experts_torch, select_experts


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 4, 2, 16), (7, 8, 2, 4), (50, 6, 3, 16), (3, 64, 8, 16)])
def test_blocks_hold_every_pair_once_each_block_one_expert(tokens, experts, top_k, block_m):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    layout = align_to_blocks(ids, experts, block_m)
    pairs = tokens * top_k
    used = int(layout.num_padded)
    assert used % block_m == 0 and used <= layout.sorted_ids.shape[0]
    assert layout.sorted_ids.shape[0] == max_padded_entries(pairs, experts, block_m)
    entries = layout.sorted_ids[:used].view(-1, block_m)
    real = entries[entries < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # each (token, expert) pair exactly once
    assert (layout.sorted_ids[used:] == pairs).all()  # the rest is padding
    flat = ids.reshape(-1)
    for block, expert in zip(entries, layout.block_expert[: used // block_m].tolist()):
        members = block[block < pairs]
        assert len(members) > 0  # no block is all padding
        assert (flat[members.long()] == expert).all()
    assert (layout.block_expert[used // block_m :] == experts).all()  # idle blocks name no expert


def test_the_layout_size_does_not_depend_on_the_routing():
    """What lets a CUDA graph hold it: same T, k, E, block -> same shapes, whatever the ids."""
    skewed = torch.zeros(9, 2, dtype=torch.int64)
    skewed[:, 1] = 1
    spread = torch.arange(18).view(9, 2) % 16
    a, b = align_to_blocks(skewed, 16, 8), align_to_blocks(spread, 16, 8)
    assert a.sorted_ids.shape == b.sorted_ids.shape and a.block_expert.shape == b.block_expert.shape


@pytest.mark.parametrize(
    "tokens,experts,top_k,hidden,inter",
    [
        (1, 4, 2, 40, 24),  # decode; widths not multiples of the blocks
        (6, 8, 2, 64, 32),
        (37, 8, 3, 48, 40),  # more tokens than experts: the prefill block shape
        (3, 16, 8, 32, 16),  # top-8 of 16 (Qwen3-MoE's k)
    ],
)
def test_fused_experts_match_the_torch_grouped_path(tokens, experts, top_k, hidden, inter):
    g = torch.Generator().manual_seed(tokens * 31 + experts)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.2
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g), top_k, renormalize=True)
    want = grouped_experts_torch(x, w13, w2, weights, ids)
    got = triton_moe.fused_experts(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_fused_experts_read_strided_expert_weights():
    """Weights may be views (e.g. a rank's slice of the intermediate width)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 32, generator=g)
    full13 = torch.randn(4, 2 * 48, 32, generator=g) * 0.2
    w13 = torch.cat([full13[:, :16], full13[:, 48:64]], dim=1)  # contiguous copy of the slice
    w2_full = torch.randn(4, 32, 48, generator=g) * 0.2
    w2 = w2_full[:, :, :16]  # a strided view
    weights, ids = select_experts(torch.randn(5, 4, generator=g), 2, renormalize=False)
    want = grouped_experts_torch(x, w13, w2, weights, ids)
    got = triton_moe.fused_experts(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_fused_experts_in_half_precision_multiply_in_that_precision():
    """fp16 operands go to tl.dot as they are (tensor cores on a GPU). bf16 takes the same
    path but cannot be checked here: the Triton interpreter's bf16 tl.dot is wrong."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(9, 64, generator=g).half()
    w13 = (torch.randn(8, 64, 64, generator=g) * 0.2).half()
    w2 = (torch.randn(8, 64, 32, generator=g) * 0.2).half()
    weights, ids = select_experts(torch.randn(9, 8, generator=g).half(), 2, renormalize=True)
    want = grouped_experts_torch(x.float(), w13.float(), w2.float(), weights.float(), ids)
    got = triton_moe.fused_experts(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)))
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.cpu().float(), want, rtol=0, atol=2e-3 * want.abs().max().item())
