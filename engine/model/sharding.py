"""What the model builder asks of a tensor-parallel split: the `Sharder` protocol, and
`WholeWeights`, its one-rank implementation (every weight whole).

The split itself (Megatron-style slices, KV heads replicated when there are fewer than
ranks) is engine/distributed/sharding.py's `Sharder`, which implements this protocol. The
model side only names what it needs, so engine/model never imports engine/distributed: the
direction is distributed -> model (tests/engine/test_import_rules.py, from the folder READMEs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from preheat.engine.kernels.int8 import QuantizedWeight, cat_rows
from preheat.engine.model.spec import ModelSpec

Weight = torch.Tensor | QuantizedWeight  # a matrix in --dtype, or int8 (--quantization int8)


@dataclass(frozen=True)
class HeadSplit:
    """One rank's heads: query heads [q_start, q_start + q_count), KV heads
    [kv_start, kv_start + kv_count)."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def concat_rows(parts: list[Weight]) -> Weight:
    """Rows stacked: int8 weights' blocks run along the input, so their rows stack freely."""
    return cat_rows(parts) if isinstance(parts[0], QuantizedWeight) else torch.cat(parts)


class Sharder(Protocol):
    """One rank's slice of each checkpoint tensor (transformers layout: a Linear weight is
    [out, in]); build_model reads every weight through it."""

    heads: HeadSplit  # the rank's query and KV heads

    def qkv(self, q: Weight, k: Weight, v: Weight) -> Weight:
        """The fused q/k/v rows (weights or biases) of the rank's heads."""

    def o(self, w: Weight) -> Weight:
        """o_proj's input columns of the rank's query heads."""

    def gate_up(self, gate: Weight, up: Weight) -> Weight:
        """Fused gate/up rows (weights or biases) of the rank's slice of the MLP width."""

    def down(self, w: Weight) -> Weight:
        """down_proj's input columns of the rank's slice of the MLP width."""

    def experts(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert's slice of w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]."""

    def reduced_bias(self, b: torch.Tensor | None) -> torch.Tensor | None:
        """A row-parallel layer's bias, or None where another rank adds it (the all-reduce
        must add it once)."""


class WholeWeights:
    """The one-rank Sharder: every weight whole, q/k/v and gate/up concatenated, so the model
    builder has one code path."""

    def __init__(self, spec: ModelSpec) -> None:
        self.heads = HeadSplit(0, spec.num_heads, 0, spec.num_kv_heads)

    def qkv(self, q: Weight, k: Weight, v: Weight) -> Weight:
        return concat_rows([q, k, v])

    def o(self, w: Weight) -> Weight:
        return w

    def gate_up(self, gate: Weight, up: Weight) -> Weight:
        return concat_rows([gate, up])

    def down(self, w: Weight) -> Weight:
        return w

    def experts(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return w13, w2

    def reduced_bias(self, b: torch.Tensor | None) -> torch.Tensor | None:
        return b
