"""The Triton paged decode kernel agrees with the PyTorch reference (engine/kernels/reference.py).

Tolerance: the reference is computed in fp32 from the very same (already rounded) inputs, then
both sides are compared with torch.testing's defaults for the output dtype
(fp32 rtol 1.3e-6 / atol 1e-5, fp16 rtol 1e-3 / atol 1e-5, bf16 rtol 1.6e-2 / atol 1e-5):
the kernel accumulates in fp32, so the only error left is its final rounding to the output dtype.
Shapes are small on purpose: on CPU this runs under the Triton interpreter.
"""

from __future__ import annotations

import math

import pytest
import torch
from _kernels import DEVICE, triton_attention

from preheat.engine.kernels import kv_fp8, reference


def paged_batch(seq_lens, page_size, num_pages, kv_heads, head_dim, dtype, seed=0):
    """A pool with random contents and a batch whose pages are scattered over it.

    Page 0 is the scratch page and never handed to a sequence; unused table entries stay 0.
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    pages_per_seq = [math.ceil(n / page_size) for n in seq_lens]
    assert sum(pages_per_seq) <= num_pages - 1, "test pool too small"
    free = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(pages_per_seq) + 1, dtype=torch.int32)
    for row, count in enumerate(pages_per_seq):
        table[row, :count] = torch.tensor([free.pop() for _ in range(count)])
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return k_cache, v_cache, table, lens, gen


def run_both(num_heads, kv_heads, seq_lens, page_size, num_pages, head_dim, dtype, **kw):
    k_cache, v_cache, table, lens, gen = paged_batch(
        seq_lens, page_size, num_pages, kv_heads, head_dim, dtype
    )
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    expected = reference.decode_attention(
        q.float(), k_cache.float(), v_cache.float(), table, lens, scale
    ).to(dtype)
    got = triton_attention.decode_attention(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE), lens.to(DEVICE),
        scale, **kw,
    )
    return got.cpu(), expected


@pytest.mark.parametrize(
    "num_heads,kv_heads",
    [(3, 3), (9, 3), (8, 2), (8, 1)],
    ids=["gqa1", "gqa3-smollm2", "gqa4", "gqa8"],
)
@pytest.mark.parametrize(
    "page_size,num_pages",
    [(4, 13), (5, 11), (16, 7)],
    ids=["ps4-13pages", "ps5-11pages", "ps16-7pages"],
)
def test_matches_reference_across_gqa_and_page_layouts(num_heads, kv_heads, page_size, num_pages):
    # Ragged lengths: one token, inside one page, exactly a page edge, across several pages.
    seq_lens = [1, page_size - 1 or 1, page_size, 2 * page_size + 3]
    got, expected = run_both(num_heads, kv_heads, seq_lens, page_size, num_pages, 32, torch.float32)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_inputs_round_only_at_the_end(dtype):
    got, expected = run_both(8, 2, [3, 21, 40], 8, 11, 64, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected)


def test_head_dim_that_is_not_a_power_of_two():
    got, expected = run_both(4, 2, [7, 30], 4, 13, 24, torch.float32)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("num_splits", [1, 2, 7])
def test_every_split_count_gives_the_same_answer(num_splits):
    # 7 splits over 1- and 9-token sequences leaves most splits empty: they must weigh nothing.
    got, expected = run_both(4, 1, [1, 9, 70], 8, 13, 32, torch.float32, num_splits=num_splits)
    torch.testing.assert_close(got, expected)


def test_reads_only_its_own_pages_and_tokens():
    k_cache, v_cache, table, lens, gen = paged_batch([6, 6], 4, 9, 2, 16, torch.float32)
    q = torch.randn(2, 4, 16, generator=gen)
    k_cache, v_cache, table, lens, q = (t.to(DEVICE) for t in (k_cache, v_cache, table, lens, q))
    before = triton_attention.decode_attention(q, k_cache, v_cache, table, lens, 0.25)
    # Poison everything outside the two sequences' live slots, scratch page 0 included.
    live = torch.zeros(9 * 4, dtype=torch.bool, device=DEVICE)
    for row in range(2):
        for pos in range(6):
            live[int(table[row, pos // 4]) * 4 + pos % 4] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, 2, 16)[~live] = 1e4
    after = triton_attention.decode_attention(q, k_cache, v_cache, table, lens, 0.25)
    torch.testing.assert_close(after, before)


def test_fp8_cache_is_dequantised_with_its_per_tensor_scales():
    k_cache, v_cache, table, lens, gen = paged_batch([5, 19], 4, 11, 2, 32, torch.float32)
    q = torch.randn(2, 8, 32, generator=gen)
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.05])
    k8, v8 = kv_fp8.quantize_fp8(k_cache, k_scale), kv_fp8.quantize_fp8(v_cache, v_scale)
    expected = reference.decode_attention(
        q,
        kv_fp8.dequantize_fp8(k8, k_scale, torch.float32),
        kv_fp8.dequantize_fp8(v8, v_scale, torch.float32),
        table,
        lens,
        32**-0.5,
    )
    got = triton_attention.decode_attention(
        q.to(DEVICE), k8.to(DEVICE), v8.to(DEVICE), table.to(DEVICE), lens.to(DEVICE), 32**-0.5,
        k_scale=k_scale.to(DEVICE), v_scale=v_scale.to(DEVICE),
    )
    torch.testing.assert_close(got.cpu(), expected)


def test_fp8_cache_without_scales_is_refused():
    k8 = torch.zeros(3, 4, 1, 16, dtype=kv_fp8.FP8_DTYPE)
    with pytest.raises(ValueError, match="k_scale"):
        triton_attention.decode_attention(
            torch.zeros(1, 2, 16), k8, k8.clone(), torch.ones(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1.0,
        )


@pytest.mark.parametrize(
    "batch,kv_heads,max_tokens,sms,expected",
    [
        (1, 3, 4096, 132, 16),  # batch 1: split as far as allowed to fill the GPU
        (32, 3, 4096, 132, 3),  # big batch: few splits needed
        (64, 8, 4096, 132, 1),  # grid already larger than two waves
        (1, 3, 40, 132, 2),  # never more splits than token blocks (40 tokens = 2 blocks)
    ],
)
def test_split_count_is_a_function_of_shapes(batch, kv_heads, max_tokens, sms, expected):
    assert triton_attention.decode_num_splits(batch, kv_heads, max_tokens, sms) == expected
