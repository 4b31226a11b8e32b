"""Sparse mixture-of-experts MLP: route each token to its top-k experts, run the experts
grouped, add their outputs weighted by the router.

Routing follows transformers for both families we run: softmax over all experts in float32,
top-k, and (Mixtral always, Qwen3-MoE with `norm_topk_prob`) rescale the k probabilities to
sum to one — for Mixtral that is exactly a softmax over the top-k logits.

Experts are computed grouped, never per token: the (token, expert) pairs are sorted by
expert and each active expert runs one gate/up and one down matmul over all its tokens
(`grouped_experts_torch`, the CPU path). On CUDA the same grouping feeds a Triton grouped
GEMM (engine/kernels/triton_moe.py) that needs no host sync, so MoE decode can be captured
in a CUDA graph; which one runs is chosen once, at build time, and handed in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# experts_fn(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k]) -> [T, H]
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k] int64), as transformers' routers
    compute them: softmax in float32, top-k, optional renormalisation."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def grouped_experts_torch(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Every active expert once over all of its tokens. The one host sync (how many tokens
    each expert got) makes this path unfit for CUDA-graph capture; the Triton path is."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, k) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start : start + n]
        gate, up = F.linear(x[rows], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * weight_of[start : start + n, None]
        out.index_add_(0, rows, y)  # ascending expert order, as transformers adds them
        start += n
    return out


class SparseMoE:
    """Router plus experts of one layer. For tensor parallelism a rank would hold every
    expert's slice of the intermediate width (w13 rows, w2 columns) and all-reduce the sum."""

    def __init__(
        self,
        router: torch.Tensor,  # [E, hidden]
        w13: torch.Tensor,  # [E, 2 * intermediate, hidden], gate rows first
        w2: torch.Tensor,  # [E, hidden, intermediate]
        top_k: int,
        renormalize: bool,
        experts_fn: ExpertsFn = grouped_experts_torch,
    ) -> None:
        num_experts = router.shape[0]
        if w13.shape[0] != num_experts or w2.shape[0] != num_experts or w13.shape[1] != 2 * w2.shape[2]:
            raise ValueError(f"expert shapes disagree: router {tuple(router.shape)}, w13 {tuple(w13.shape)}, "
                             f"w2 {tuple(w2.shape)}")  # fmt: skip
        self.router, self.w13, self.w2 = router, w13, w2
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = w2.shape[2]
        self.experts_fn = experts_fn

    def weights(self) -> list[torch.Tensor]:
        return [self.router, self.w13, self.w2]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = select_experts(F.linear(x, self.router), self.top_k, self.renormalize)
        out = self.experts_fn(x, self.w13, self.w2, weights, ids)
        return out if residual is None else residual + out
