"""Which slice of each weight a tensor-parallel rank holds (Megatron-style), as pure functions.

Attention: q/k/v are column-parallel — rank r computes query heads
[r * H/N, (r+1) * H/N) and the KV heads those queries read — and o_proj is row-parallel (its
input columns are those heads), so each rank's o_proj output is a partial sum that
`DecoderLayer.forward` all-reduces. With at least as many KV heads as ranks, the KV heads are
split like the query heads. With fewer (GQA with, say, 8 KV heads over 16 ranks, or 1 KV head
over 2), each KV head is *replicated* on the N / KVH ranks whose query heads read it: rank r
keeps KV head r * KVH // N, exactly one, and its pool holds only that head.

Dense MLP: gate/up column-parallel, down row-parallel, all-reduced. Mixture of experts: tensor
parallel *inside every expert* (each rank holds every expert's slice of the intermediate
width; the router is replicated), which is vLLM's default and keeps routing identical on
every rank; expert parallelism (whole experts per rank) is not implemented.

Embedding and LM head are replicated, not vocab-parallel: every rank holds them in full and
only rank 0 computes logits. That costs each rank a copy of the embedding (and LM head) —
small next to the layers of a model that needs tensor parallelism — and saves a collective.

A bias of a row-parallel layer (o_proj, down_proj) is added on rank 0 only, so the all-reduce
adds it once.

`Sharder` implements engine/model/sharding.py's protocol of the same name (the model builder
reads weights through it); with one rank it is that module's `WholeWeights`.
"""

from __future__ import annotations

import torch

from preheat.engine.kernels.int8 import BLOCK
from preheat.engine.model.sharding import HeadSplit, Weight, WholeWeights
from preheat.engine.model.sharding import concat_rows as _cat
from preheat.engine.model.spec import ModelSpec

__all__ = ["HeadSplit", "Sharder", "TensorParallelError", "Weight", "check_tp_size", "head_split",
           "kv_head_sources", "local_kv_heads"]


class TensorParallelError(ValueError):
    """A model / --tensor-parallel-size combination that cannot be sharded; the message says
    which count does not divide."""


def check_tp_size(spec: ModelSpec, size: int, quantization: str | None = None) -> None:
    """Raises TensorParallelError when `spec` cannot be split over `size` ranks. With int8
    weights a row-parallel matrix (o_proj, down_proj) is cut along its input, which only
    works at its 32-wide blocks; a matrix whose whole input is no multiple of 32 is not
    quantized (engine/model/quantize.py) and splits like any tensor."""
    if size < 1:
        raise TensorParallelError(f"--tensor-parallel-size must be at least 1, got {size}")
    problems = []
    if spec.num_heads % size:
        problems.append(f"{spec.num_heads} attention heads")
    kv = spec.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"{kv} KV heads (need a multiple of the size, or a divisor of it: replicated)")
    has_dense = spec.moe is None or len(spec.moe.sparse_layers) < spec.num_layers
    if has_dense and spec.intermediate_size % size:
        problems.append(f"MLP width {spec.intermediate_size}")
    if spec.moe is not None and spec.moe.intermediate_size % size:
        problems.append(f"expert width {spec.moe.intermediate_size}")
    if quantization == "int8" and not problems:
        inputs = {"o_proj input": spec.num_heads * spec.head_dim}
        if has_dense:
            inputs["MLP width"] = spec.intermediate_size
        for what, width in inputs.items():
            if width % BLOCK == 0 and (width // size) % BLOCK:
                problems.append(f"{what} {width} with --quantization int8 (each rank's {width // size} columns "
                                f"must be whole blocks of {BLOCK})")
    if problems:
        raise TensorParallelError(
            f"--tensor-parallel-size {size} does not divide this model ({spec.architecture}): "
            + "; ".join(problems)
        )


def head_split(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadSplit:
    """Rank `rank`'s query and KV heads (see the module docstring for replication)."""
    q_count = num_heads // size
    if num_kv_heads >= size:
        kv_count = num_kv_heads // size
        return HeadSplit(rank * q_count, q_count, rank * kv_count, kv_count)
    return HeadSplit(rank * q_count, q_count, rank * num_kv_heads // size, 1)


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads each rank's pool holds."""
    return max(1, num_kv_heads // size)


def kv_head_sources(num_kv_heads: int, size: int) -> list[tuple[int, int]]:
    """For each KV head, (rank, local index) of the first rank holding it: where a gather of
    the whole KV takes that head from (a replicated head is taken once)."""
    sources: dict[int, tuple[int, int]] = {}
    for rank in range(size):
        split = head_split(num_kv_heads, num_kv_heads, size, rank)  # query heads do not matter
        for i in range(split.kv_count):
            sources.setdefault(split.kv_start + i, (rank, i))
    return [sources[h] for h in range(num_kv_heads)]


def _part(t: Weight, dim: int, start: int, count: int) -> Weight:
    return t.narrow(dim, start, count)


class Sharder(WholeWeights):
    """Cuts checkpoint tensors (transformers layout: a Linear weight is [out, in]) into one
    rank's slice. With size 1 every method returns the whole (concatenated) tensor, as
    WholeWeights does."""

    def __init__(self, spec: ModelSpec, size: int = 1, rank: int = 0) -> None:
        if size > 1:
            check_tp_size(spec, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside tensor-parallel size {size}")
        self.size, self.rank, self.head_dim = size, rank, spec.head_dim
        self.heads = head_split(spec.num_heads, spec.num_kv_heads, size, rank)

    def qkv(self, q: Weight, k: Weight, v: Weight) -> Weight:
        """The fused q/k/v rows (weights or biases) of this rank's heads."""
        if self.size == 1:
            return super().qkv(q, k, v)
        hd, s = self.head_dim, self.heads
        return _cat([
            _part(q, 0, s.q_start * hd, s.q_count * hd),
            _part(k, 0, s.kv_start * hd, s.kv_count * hd),
            _part(v, 0, s.kv_start * hd, s.kv_count * hd),
        ])  # fmt: skip

    def o(self, w: Weight) -> Weight:
        """o_proj's input columns of this rank's query heads."""
        if self.size == 1:
            return super().o(w)
        return _part(w, 1, self.heads.q_start * self.head_dim, self.heads.q_count * self.head_dim).contiguous()

    def _width(self, full: int) -> tuple[int, int]:
        n = full // self.size
        return self.rank * n, n

    def gate_up(self, gate: Weight, up: Weight) -> Weight:
        """Fused gate/up rows (weights or biases) of this rank's slice of the MLP width."""
        if self.size == 1:
            return super().gate_up(gate, up)
        start, n = self._width(gate.shape[0])
        return _cat([_part(gate, 0, start, n), _part(up, 0, start, n)])

    def down(self, w: Weight) -> Weight:
        """down_proj's input columns of this rank's slice of the MLP width."""
        if self.size == 1:
            return super().down(w)
        start, n = self._width(w.shape[1])
        return _part(w, 1, start, n).contiguous()

    def experts(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert's slice: w13 [E, 2I, H] -> [E, 2I/N, H] (gate rows, then up rows),
        w2 [E, H, I] -> [E, H, I/N]."""
        if self.size == 1:
            return super().experts(w13, w2)
        width = w2.shape[2]
        start, n = self._width(width)
        gate_up = torch.cat([_part(w13, 1, start, n), _part(w13, 1, width + start, n)], dim=1)
        return gate_up, _part(w2, 2, start, n).contiguous()

    def reduced_bias(self, b: torch.Tensor | None) -> torch.Tensor | None:
        """A row-parallel layer's bias: on rank 0 only, so the all-reduce adds it once."""
        return b if self.rank == 0 else None
