"""A padded decode step through CudaGraphRunner, with the real Triton kernels inside.

Padding rows (slot 0, page-table row of 0s, seq_len 1) must be harmless: they write only into
scratch page 0, and the real rows come out exactly as an unpadded eager step computes them.
The graph backend is the same fake as in tests/test_cuda_graph_runner.py: it replays by
re-running the function on the static buffers.
"""

from __future__ import annotations

import torch
from _kernels import DEVICE, triton_attention, triton_kv

from preheat.engine.cuda_graph import CudaGraphRunner, DecodeInputs

PAGE, PAGES, KVH, HEADS, HD = 4, 9, 2, 8, 16


class FakeGraphs:
    def capture(self, fn):
        out = fn()
        return (lambda: out.copy_(fn())), out


def make_decode(k_cache, v_cache):
    def decode(inputs: DecodeInputs) -> torch.Tensor:
        # K/V/Q derived from the token id so every row's work depends on its own input only.
        x = inputs.input_ids.float()[:, None, None] / 100 + torch.linspace(0, 1, HD, device=DEVICE)
        k = x.expand(-1, KVH, HD).contiguous()
        triton_kv.write_kv(k_cache, v_cache, k, -k, inputs.slots)
        q = x.expand(-1, HEADS, HD).contiguous()
        return triton_attention.decode_attention(
            q, k_cache, v_cache, inputs.page_table, inputs.seq_lens, HD**-0.5
        )

    return decode


def test_padding_rows_touch_only_scratch_page_zero():
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(PAGES, PAGE, KVH, HD, generator=gen).to(DEVICE)
    v_cache = torch.randn(PAGES, PAGE, KVH, HD, generator=gen).to(DEVICE)
    # Three sequences (3 rows pad to a graph of 4): lengths 2, 5, 7 on scattered pages.
    table = torch.tensor([[3, 0], [5, 1], [8, 2]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([2, 5, 7], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([3 * PAGE + 1, 1 * PAGE + 0, 2 * PAGE + 2], device=DEVICE)
    inputs = DecodeInputs(
        input_ids=torch.tensor([5, 17, 42], device=DEVICE),
        positions=(lens - 1).long(),
        slots=slots,
        page_table=table,
        seq_lens=lens,
    )

    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    expected = make_decode(eager_k, eager_v)(inputs)

    runner = CudaGraphRunner(
        make_decode(k_cache, v_cache), max_bs=4, max_pages=3, device=DEVICE, backend=FakeGraphs()
    )
    runner.capture()
    got = runner.run(inputs)

    torch.testing.assert_close(got, expected)
    # Every page but scratch page 0 ends up exactly as the unpadded eager step left it.
    assert torch.equal(k_cache[1:], eager_k[1:]) and torch.equal(v_cache[1:], eager_v[1:])
