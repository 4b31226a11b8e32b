"""Triton paged-attention decode (flash-decoding with a split over the sequence), GQA aware.

Contract (docs/engine-internals.md):
    decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale) -> [B, H, hd]
    q: [B, H, hd]; k_cache/v_cache: [num_pages, page_size, kvh, hd];
    page_table: int32 [B, max_pages] (unused entries 0); seq_lens: int32 [B], >= 1.
    Query head h reads KV head h // (H // kvh).
Extra keywords: k_scale/v_scale (float32 [1]) for an fp8 cache; num_splits to pin the split.

Why this shape:
- One program per (sequence, KV head, split) handles *all* query heads of that KV head, so
  each K/V row is read from memory once per group, not once per query head (GQA saves
  bandwidth only if the kernel exploits it). The group is padded to 16 rows so tl.dot can run.
- Splitting the sequence (stage 1) then merging partial softmaxes by log-sum-exp (stage 2)
  keeps the GPU busy at small batch: batch 1 with 3 KV heads would otherwise be 3 programs.
- The grid and the split count depend on tensor *shapes* only, never on seq_lens values, and
  the loop bounds are read from device memory: no host sync, so the call can be captured
  in a CUDA graph and replayed with new sequence lengths.
- K/V tokens are gathered one by one through the page table (page = n // page_size), so any
  page size works and a block of tokens may span pages.
- Operands are upcast to fp32 before tl.dot: fp8 needs dequantising anyway, the Triton
  interpreter computes bf16 tl.dot wrongly, and decode is bandwidth-bound, not FLOP-bound.
"""

from __future__ import annotations

import torch

from preheat.engine.kernels.kv_fp8 import is_fp8
from preheat.engine.kernels.triton_import import tl, triton

BLOCK_N = 32  # tokens per inner step
MIN_DOT = 16  # tl.dot needs every dimension >= 16


@triton.jit
def _decode_stage1(
    Q,
    KC,
    VC,
    PageTable,
    SeqLens,
    KScale,
    VScale,
    MidO,
    MidLse,
    sm_scale,
    stride_qb,
    stride_qh,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_ptb,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + b)
    # Each split owns a whole number of blocks; trailing splits of short sequences are empty.
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    if HAS_SCALE:
        k_scale = tl.load(KScale)
        v_scale = tl.load(VScale)

    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        page = tl.load(PageTable + b * stride_ptb + n // PAGE_SIZE, mask=nmask, other=0)
        row = page.to(tl.int64) * stride_cp + (n % PAGE_SIZE) * stride_cs + kvh * stride_ch
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(KC + row[:, None] + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
        v = tl.load(VC + row[:, None] + d[None, :], mask=kvmask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            k = k * k_scale
            v = v * v_scale

        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    # An empty split leaves l_i == 0: store lse = -inf so stage 2 gives it zero weight.
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log(safe_l), float("-inf"))
    tl.store(
        MidO + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + d[None, :],
        acc / safe_l[:, None],
        mask=gmask[:, None] & dmask[None, :],
    )
    tl.store(MidLse + b * stride_mlb + heads * stride_mlh + split, lse, mask=gmask)


@triton.jit
def _decode_stage2(
    MidO,
    MidLse,
    Out,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < NUM_SPLITS
    lse = tl.load(MidLse + b * stride_mlb + h * stride_mlh + s, mask=smask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))  # split 0 is never empty (seq_len >= 1): max is finite
    o = tl.load(
        MidO + b * stride_mob + h * stride_moh + s[:, None] * stride_mos + d[None, :],
        mask=smask[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


def decode_num_splits(batch: int, kv_heads: int, max_tokens: int, sm_count: int) -> int:
    """How many sequence splits stage 1 uses: enough programs to fill ~2 waves of SMs.

    A pure function of shapes and the device, so a captured graph keeps a valid value:
    never more splits than token blocks in the longest possible sequence, at most 16.
    """
    want = triton.cdiv(2 * sm_count, max(1, batch * kv_heads))
    most = max(1, min(16, triton.cdiv(max_tokens, BLOCK_N)))
    return max(1, min(want, most))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter runs: a few splits so the merge path is exercised


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    batch, num_heads, hd = q.shape
    _, page_size, kvh, hd_c = k_cache.shape
    assert hd_c == hd and num_heads % kvh == 0, "q heads must be a multiple of kv heads"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    group = num_heads // kvh
    quant = is_fp8(k_cache)
    if quant and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    if num_splits is None:
        num_splits = decode_num_splits(
            batch, kvh, page_table.shape[1] * page_size, _sm_count(q.device)
        )

    out = torch.empty_like(q)
    if batch == 0:
        return out
    mid_o = torch.empty(batch, num_heads, num_splits, hd, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = max(MIN_DOT, triton.next_power_of_2(hd))
    ks = k_scale if quant else seq_lens
    vs = v_scale if quant else seq_lens

    _decode_stage1[(batch, kvh, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        ks,
        vs,
        mid_o,
        mid_lse,
        float(scale),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        page_table.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        PAGE_SIZE=page_size,
        GROUP=group,
        HEAD_DIM=hd,
        NUM_SPLITS=num_splits,
        BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
        HAS_SCALE=quant,
    )
    _decode_stage2[(batch, num_heads)](
        mid_o,
        mid_lse,
        out,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=hd,
        NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
    )
    return out


# The name TritonBackend binds (engine/kernels/triton_backend.py; reference.decode_attention's signature).
decode_attention = decode_attention_triton
