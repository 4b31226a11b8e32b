"""Our forward pass for the decoder-only families we run (Llama, Mistral, Qwen2, Qwen3,
Qwen3-MoE, Mixtral) over the paged KV pool.

Tokens of all sequences in a step are laid back to back ("flat"): decode rows first (one
token per sequence), then the new tokens of extending sequences. Linear layers run on all of
them at once; only attention looks at which sequence a row belongs to. A layer is
`h += attn(norm(h)); h += mlp(norm(h))`, where the MLP is dense or a sparse mixture of
experts (engine/model/moe.py) — the families differ only in the parts' options, which the
ModelSpec carries.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from preheat.engine.kernels.backend import KernelBackend
from preheat.engine.kernels.int8 import QuantizedWeight
from preheat.engine.kernels.linear import LinearWeight
from preheat.engine.kernels.rope import RotaryEmbedding
from preheat.engine.kernels.torch_backend import TorchBackend
from preheat.engine.model import decode_stack, weight_arena
from preheat.engine.model.layers import Attention, AttentionMetadata, DenseMLP, StepContext
from preheat.engine.model.moe import SparseMoE
from preheat.engine.model.spec import ModelSpec

__all__ = ["AttentionMetadata", "DecoderLayer", "DecoderModel", "Reduce", "padded_rows"]

# Sums a row-parallel layer's partial output over the tensor-parallel ranks (in place or not;
# returns the sum). None on a single rank.
Reduce = Callable[[torch.Tensor], torch.Tensor]


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether b is a's rows as they are: the same storage, offset, shape and strides."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def padded_rows(n: int) -> int:
    """Row count the CPU matmuls run at. oneDNN builds (and caches) a kernel per matrix shape,
    and building one costs ~2-5 ms per weight shape: with mixed batches every step would
    have a new row count. Rounding up to buckets keeps the set of shapes small and cached;
    buckets of 16 up to a default prefill chunk (512) waste at most 15 rows where the
    chunk-sized steps of a new turn land (rounding 444 rows up to 512 cost ~20% there)."""
    if n <= 16:
        return 1 << (n - 1).bit_length()
    if n <= 512:
        return -(-n // 16) * 16
    return -(-n // 64) * 64


class DecoderLayer:
    def __init__(
        self, input_norm: torch.Tensor, attn: Attention, post_norm: torch.Tensor, mlp: DenseMLP | SparseMoE, eps: float,
        reduce: Reduce | None = None, backend: KernelBackend | None = None,
    ) -> None:  # fmt: skip
        self.input_norm, self.attn, self.post_norm, self.mlp, self.eps = input_norm, attn, post_norm, mlp, eps
        self.backend = backend or TorchBackend()
        # Tensor parallel: o_proj and down_proj are row-parallel, so each rank's attention and
        # MLP outputs are partial sums; `reduce` all-reduces them before the residual add.
        self.reduce = reduce

    def weights(self) -> list[torch.Tensor]:
        return [self.input_norm, self.post_norm, *self.attn.weights(), *self.mlp.weights()]

    def forward(self, h: torch.Tensor, ctx: StepContext, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        norm = self.backend.rms_norm
        if self.reduce is None:
            # The residual adds happen inside the output projections (one pass fewer each).
            h = self.attn.forward(norm(h, self.input_norm, self.eps), ctx, k_cache, v_cache, residual=h)
            return self.mlp.forward(norm(h, self.post_norm, self.eps), residual=h)
        # Tensor parallel: each rank's output is a partial sum, all-reduced before the residual.
        h = h + self.reduce(self.attn.forward(norm(h, self.input_norm, self.eps), ctx, k_cache, v_cache))
        return h + self.reduce(self.mlp.forward(norm(h, self.post_norm, self.eps)))


class DecoderModel:
    """Embedding, layers, final norm and LM head; runs one flat batch per call."""

    def __init__(
        self,
        spec: ModelSpec,
        embed: torch.Tensor,
        layers: list[DecoderLayer],
        norm: torch.Tensor,
        lm_head: torch.Tensor | QuantizedWeight | LinearWeight,
        rope: RotaryEmbedding,
        graphs_off_reason: str | None = None,
        backend: KernelBackend | None = None,
    ) -> None:
        self.spec = spec
        self.embed, self.layers, self.norm, self.rope = embed, layers, norm, rope
        # The kernels every part was built for (build_model hands the same one to each).
        self.backend = backend or TorchBackend()
        self.lm_head = self.backend.prepare_linear(lm_head, None, embed.dtype)
        # Why decode cannot be captured in a CUDA graph (the runner adds it to its own
        # reasons), e.g. experts on the torch path, which syncs with the host.
        self.graphs_off_reason = graphs_off_reason
        # What one decode step reads from memory: every matrix and norm once (the embedding
        # is a lookup of a few rows; tied, it is read in full as the LM head). With experts
        # this is an upper bound: a step reads only the experts its tokens chose.
        seen: set[int] = set()
        self.step_weight_bytes = 0
        for t in [norm, *self.lm_head.tensors(), *(w for layer in layers for w in layer.weights())]:
            if id(t) not in seen:
                seen.add(id(t))
                self.step_weight_bytes += t.numel() * t.element_size()
        # oneDNN builds a kernel per matrix shape (cuBLAS and our CPU kernels need none).
        self.pad_rows = embed.device.type == "cpu" and self.backend.pad_cpu_rows
        # The huge-page arena the matrices live in once the engine's WeightMove has swapped
        # them in (engine/model/weight_arena.py), else None.
        self.weight_arena: weight_arena.Arena | None = None
        # Decode steps' layers in one call into the CPU kernels, where every layer allows it.
        self.decode_stack = decode_stack.build(self)
        # (normed rows, logits) of the last forward when the stack ran the head (see logits).
        self._step_logits: tuple[torch.Tensor, torch.Tensor] | None = None

    def matrices(self) -> list[LinearWeight]:
        """Every prepared matrix a step multiplies by: the layers' (attention's and the MLP's
        own attributes; experts keep their own storage) and the LM head."""
        out = [w for layer in self.layers for part in (layer.attn, layer.mlp) for w in vars(part).values()
               if isinstance(w, LinearWeight)]  # fmt: skip
        return out + ([self.lm_head] if isinstance(self.lm_head, LinearWeight) else [])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_pool) -> torch.Tensor:
        """Returns final hidden states [T, hidden] (after the last norm)."""
        rows = input_ids.shape[0]
        pad = padded_rows(rows) - rows if self.pad_rows else 0
        positions = meta.positions
        if pad:  # padding rows run through the matmuls only; attention never sees them
            input_ids = F.pad(input_ids, (0, pad))
            positions = F.pad(positions, (0, pad))
        h = F.embedding(input_ids, self.embed)
        kernels = self.backend
        ctx = StepContext(
            meta=meta,
            rows=rows,
            padded_rows=rows + pad,
            rope=kernels.rope_inputs(self.rope, positions, self.spec.head_dim),
            prepared_decode=(
                kernels.prepare_decode(meta.decode_page_table, meta.decode_seq_lens, kv_pool.page_size)
                if meta.num_decode
                else None
            ),
            prepared_extend=(
                kernels.prepare_extend(
                    meta.extend_page_table, meta.extend_prefix_lens, meta.extend_lens, kv_pool.page_size
                )
                if meta.extend_lens
                else None
            ),
        )
        self._step_logits = None
        stacked = self.decode_stack.rows(ctx, h, kv_pool) if self.decode_stack is not None else None
        if stacked is not None:
            h, logits = self.decode_stack.forward(h, ctx, kv_pool, stacked)
            if logits is not None:  # the stack ran the final norm and the head as well
                self._step_logits = (h, logits)
                return h
        else:
            for index, layer in enumerate(self.layers):
                h = layer.forward(h, ctx, kv_pool.k(index), kv_pool.v(index))
        return kernels.rms_norm(h[:rows], self.norm, self.spec.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The decode stack's logits of the last forward, once, when asked for the very rows it
        # returned (same storage and shape); the sampler's retry after a failed batch asks
        # again and gets fresh ones, as it must (sampling changes them in place).
        step, self._step_logits = self._step_logits, None
        if step is not None and _same_rows(step[0], hidden):
            return step[1]
        rows = hidden.shape[0]
        pad = padded_rows(rows) - rows if self.pad_rows else 0
        if pad:
            hidden = F.pad(hidden, (0, 0, 0, pad))
        return self.backend.apply_linear(hidden, self.lm_head)[:rows].to(torch.float32)
