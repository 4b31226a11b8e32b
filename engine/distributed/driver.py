"""Rank 0's model under tensor parallelism: each forward pass first hands its inputs to the
workers (one broadcast), then runs rank 0's shard while the workers run theirs; the
all-reduces inside the layers keep the ranks in step. Only rank 0 computes logits (the LM
head is replicated and the hidden states are identical on every rank after the last
all-reduce), so sampling, the scheduler, the radix cache and the detokenizer live on rank 0
alone and the runner, the engine and CUDA-graph code see an ordinary model.
"""

from __future__ import annotations

from typing import Any

import torch

from preheat.engine.model.decoder import AttentionMetadata, DecoderModel

# Captured graphs would have to replay the NCCL all-reduces in lockstep on every rank; until
# that is verified on GPUs, tensor-parallel decode runs eagerly (docs/tensor-parallel.md).
GRAPHS_OFF = "tensor parallel: decode runs eagerly (collectives are not captured in CUDA graphs yet)"


class DrivenModel:
    """Wraps rank 0's DecoderModel; everything but forward is the wrapped model's."""

    def __init__(self, model: DecoderModel, tp: Any) -> None:
        self.model = model
        self.tp = tp
        self.graphs_off_reason = GRAPHS_OFF

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_pool: Any) -> torch.Tensor:
        with self.tp.exclusive():
            self.tp.broadcast_step(input_ids, meta)
            return self.model.forward(input_ids, meta, kv_pool)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
