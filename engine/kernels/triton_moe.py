"""Mixture-of-experts experts on CUDA: two grouped GEMMs over expert-sorted token blocks.

Same contract as engine/model/moe.py's `grouped_experts_torch`:
    x [T, H], w13 [E, 2I, H] (gate rows first), w2 [E, H, I], topk_weights [T, k],
    topk_ids [T, k] -> [T, H] = sum_j topk_weights[t, j] * expert_{ids[t, j]}(x[t])

The (token, expert) pairs are laid out in blocks of one expert each (moe_align.py); one
program computes a BLOCK_M x BLOCK_N tile of one block: it gathers the block's token rows
of A, multiplies by that expert's weight tile and scatters the rows back to their pair.
GEMM 1 computes gate|up for every pair, SiLU-and-multiply runs in torch, GEMM 2 computes
the down projection and applies the router weight, and the k pairs of a token are summed.

Why a kernel rather than the torch loop over experts: the torch path asks the host how many
tokens each expert got (a sync), so decode with experts could not be captured in a CUDA
graph, and it launches 3 matmuls per active expert (up to 3 x 128 per layer for Qwen3-MoE).
Here the grid is sized by the worst case (a function of T only) and idle blocks exit, so a
layer is 2 launches plus a few elementwise ops, all capturable.

Operands keep their dtype (bf16/fp16 use tensor cores); fp32 uses exact ("ieee") products,
not TF32. Tests run this under TRITON_INTERPRET=1 on CPU in float32 and float16; the
interpreter's bf16 tl.dot is wrong (see triton_attention.py), so bf16 is checked only by
benchmarks/gpu_check.py on a GPU. Block sizes are untuned defaults.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from preheat.engine.kernels.moe_align import BlockLayout, align_to_blocks
from preheat.engine.kernels.triton_import import tl, triton


@triton.jit
def _grouped_gemm_kernel(
    A,  # [rows_a, K]
    B,  # [E, N, K]
    C,  # [num_pairs, N]
    SortedIds,
    BlockExpert,
    NumPadded,
    TopkWeights,  # [num_pairs]
    N,
    K,
    num_pairs,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    A_ROW_DIV: tl.constexpr,  # pair -> row of A: token (pair // k) for GEMM 1, the pair itself for GEMM 2
    MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + offs_m)
    valid = pair < num_pairs
    a_row = (pair // A_ROW_DIV).to(tl.int64)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        w = tl.load(TopkWeights + pair, mask=valid, other=0.0)
        acc = acc * w.to(tl.float32)[:, None]
    c_ptrs = C + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def block_config(num_tokens: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K). Few tokens per expert (decode): short blocks waste less
    padding; many (prefill): taller tiles reuse each weight tile more. vLLM's untuned defaults."""
    if num_tokens <= num_experts:
        return 16, 32, 64
    return 64, 64, 32


def _grouped_gemm(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, layout: BlockLayout, topk_weights: torch.Tensor | None,
    a_row_div: int, block_n: int, block_k: int,
) -> None:  # fmt: skip
    num_pairs, n = out.shape
    k = b.shape[2]
    grid = (layout.max_blocks, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, out, layout.sorted_ids, layout.block_expert, layout.num_padded,
        topk_weights if topk_weights is not None else out,
        n, k, num_pairs,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=topk_weights is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=layout.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, _ = w13.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    block_m, block_n, block_k = block_config(num_tokens, num_experts)
    layout = align_to_blocks(topk_ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    gate_up = torch.empty((num_pairs, two_i), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, layout, None, top_k, block_n, block_k)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up
    down = torch.empty((num_pairs, x.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, down, layout, topk_weights.reshape(-1).contiguous(), 1, block_n, block_k)
    return down.view(num_tokens, top_k, -1).sum(dim=1)
