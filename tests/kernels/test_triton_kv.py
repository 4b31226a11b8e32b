"""The Triton KV write kernel stores exactly what reference.write_kv stores, and its fp8 store
matches kv_fp8.write_kv_fp8_reference.

Both are bit for bit: a store is a copy, and the fp8 store rounds to nearest even in fp32
before its cast, so it produces the bits torch's float8_e4m3fn conversion does (the kernel
does that rounding by hand because the Triton interpreter's own fp8 cast is wrong).
"""

from __future__ import annotations

import pytest
import torch
from _kernels import DEVICE, triton_kv

from preheat.engine.kernels import kv_fp8, reference


def pool(num_pages, page_size, kv_heads, head_dim, dtype):
    shape = (num_pages, page_size, kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size,kv_heads,head_dim", [(4, 2, 32), (5, 3, 24), (16, 1, 64)])
def test_stores_each_row_at_its_slot_bit_for_bit(dtype, page_size, kv_heads, head_dim):
    num_pages = 7
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(6, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(6, kv_heads, head_dim, generator=gen).to(dtype)
    # Slots on several pages, the last slot of the pool, and scratch page 0 (padding rows).
    slots = torch.tensor([0, page_size - 1, page_size, 3 * page_size + 2, 5 * page_size + 1,
                          num_pages * page_size - 1])
    want_k, want_v = pool(num_pages, page_size, kv_heads, head_dim, dtype)
    reference.write_kv(want_k, want_v, k, v, slots)
    got_k, got_v = (t.to(DEVICE) for t in pool(num_pages, page_size, kv_heads, head_dim, dtype))
    triton_kv.write_kv(got_k, got_v, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(got_k.cpu(), want_k)
    assert torch.equal(got_v.cpu(), want_v)


def test_writes_through_a_strided_view_of_the_pool():
    # The pool hands out kv[layer, 0] / kv[layer, 1]: views whose page stride skips the other.
    kv = torch.zeros(2, 2, 5, 4, 2, 8, device=DEVICE)  # [layers, k/v, pages, page_size, kvh, hd]
    k = torch.randn(3, 2, 8, device=DEVICE)
    v = torch.randn(3, 2, 8, device=DEVICE)
    slots = torch.tensor([5, 6, 19], device=DEVICE)
    triton_kv.write_kv(kv[1, 0], kv[1, 1], k, v, slots)
    assert torch.equal(kv[1, 0].reshape(-1, 2, 8)[slots], k)
    assert torch.equal(kv[1, 1].reshape(-1, 2, 8)[slots], v)
    assert kv[0].abs().sum() == 0, "another layer was written"
    assert kv[1, 0].reshape(-1, 2, 8)[[0, 1, 2, 3, 4, 7]].abs().sum() == 0


def test_no_rows_is_a_no_op():
    k_cache, v_cache = pool(3, 4, 1, 16, torch.float32)
    empty = torch.zeros(0, 1, 16)
    triton_kv.write_kv(k_cache, v_cache, empty, empty, torch.zeros(0, dtype=torch.int64))
    assert k_cache.abs().sum() == 0


def same_bits(got, want):
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


def test_fp8_store_quantises_with_the_per_tensor_scale():
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(9, 2, 32, generator=gen) * 3
    v = torch.randn(9, 2, 32, generator=gen) * 0.01
    slots = torch.tensor([0, 4, 5, 6, 17, 18, 30, 31, 43])
    k_scale, v_scale = torch.tensor([3 / 100]), torch.tensor([1e-4])
    want_k, want_v = pool(11, 4, 2, 32, kv_fp8.FP8_DTYPE)
    kv_fp8.write_kv_fp8_reference(want_k, want_v, k, v, slots, k_scale, v_scale)
    got_k, got_v = (t.to(DEVICE) for t in pool(11, 4, 2, 32, kv_fp8.FP8_DTYPE))
    triton_kv.write_kv(
        got_k, got_v, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE),
        k_scale=k_scale.to(DEVICE), v_scale=v_scale.to(DEVICE),
    )
    same_bits(got_k, want_k)
    same_bits(got_v, want_v)
    # And the round trip stays within fp8 precision of the original values.
    back = kv_fp8.dequantize_fp8(got_k.cpu(), k_scale, torch.float32).view(-1, 2, 32)[slots]
    torch.testing.assert_close(back, k, rtol=2**-3, atol=2**-9 * float(k_scale))


def test_fp8_rounding_is_to_nearest_even_like_torch():
    # Ties (17 -> 16, 21 -> 20), a carry into the exponent (31.6 -> 32), subnormals
    # (steps of 2**-9, with a tie at 0.5 step -> 0), and tiny negatives (-> -0).
    step = 2.0**-9
    values = [17.0, 19.0, 21.0, -17.0, 31.6, 127.9, 447.0, 0.0, 1e-3, 0.5 * step,
              1.5 * step, 0.7 * step, -1e-4, -3.3, 0.015625, 0.0155]
    k = torch.tensor(values).view(len(values), 1, 1).expand(-1, 1, 16).contiguous()
    slots = torch.arange(len(values))
    want_k, want_v = pool(8, 2, 1, 16, kv_fp8.FP8_DTYPE)
    one = torch.ones(1)
    kv_fp8.write_kv_fp8_reference(want_k, want_v, k, k, slots, one, one)
    got_k, got_v = (t.to(DEVICE) for t in pool(8, 2, 1, 16, kv_fp8.FP8_DTYPE))
    triton_kv.write_kv(got_k, got_v, k.to(DEVICE), k.to(DEVICE), slots.to(DEVICE),
                       k_scale=one.to(DEVICE), v_scale=one.to(DEVICE))
    same_bits(got_k, want_k)


def test_fp8_store_saturates_instead_of_making_nan():
    # float8_e4m3fn has no infinity: an unclamped overflow would be NaN and poison attention.
    k = torch.tensor([[[1e6, -1e6, 500.0, 1.0]]])
    k_cache, v_cache = (t.to(DEVICE) for t in pool(2, 2, 1, 4, kv_fp8.FP8_DTYPE))
    one = torch.ones(1, device=DEVICE)
    triton_kv.write_kv(k_cache, v_cache, k.to(DEVICE), k.to(DEVICE), torch.tensor([2], device=DEVICE),
                       k_scale=one, v_scale=one)
    assert k_cache.float().view(-1, 1, 4)[2, 0].tolist() == [448.0, -448.0, 448.0, 1.0]


def test_fp8_store_without_scales_is_refused():
    k_cache, v_cache = pool(2, 2, 1, 4, kv_fp8.FP8_DTYPE)
    with pytest.raises(ValueError, match="k_scale"):
        triton_kv.write_kv(k_cache, v_cache, torch.ones(1, 1, 4), torch.ones(1, 1, 4),
                           torch.tensor([1]))
