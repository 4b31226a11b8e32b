"""A decode step's layers in one call into the CPU kernels (engine/kernels/cpu/decode_stack.h).

DecoderLayer.forward makes ~9 kernel calls a layer, each through Python (the backend's
checks, linear.apply, the binding): at batch 1 on SmolLM2 that is ~0.6 ms of a ~4 ms step.
The stack runs the same kernels in the same order with the same arguments inside C++, so a
step's output is the same to the bit (tests/engine/test_decode_stack.py holds it to that).

`build` makes a stack when every layer is one the stack runs — the CPU kernel backend's
packed products, a dense SiLU-gated MLP, no q/k norm, one rank — else None (the layers run
as before). `rows` decides per step: decode rows only (or a speculative verify step of up to
VERIFY_ROWS draft rows, run as decode rows: `_decode_rows`), no padding, the rotary table kernel,
a cache in the activations' dtype or fp8 (its scales handed to the stack with the pool's
views), fewer rows than any product's dense-rows threshold. PREHEAT_DECODE_STACK=0 turns it
off (to compare, or to step around it).

Where the model's LM head is such a packed product too, the stack also runs the final norm
and the head in the same call: the step's logits come back with its hidden states, and
DecoderModel.logits hands them out for those very rows instead of multiplying again.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from preheat.engine.kernels import cpu_attention, kv_fp8
from preheat.engine.kernels.linear import LinearWeight
from preheat.engine.model.layers import AttentionMetadata, DenseMLP, StepContext

if TYPE_CHECKING:
    from preheat.engine.model.decoder import DecoderModel

log = logging.getLogger(__name__)

ENV_SWITCH = "PREHEAT_DECODE_STACK"
KINDS = {"bf16": 0, "f32": 1, "int8": 2}  # decode_stack.h's StackLinear::kind


class DecodeStack:
    """The C++ stack of one model and what a step must satisfy to use it."""

    def __init__(self, native: Any, dtype: torch.dtype, dense_from_rows: int | None,
                 head_dense_from_rows: int | None = None) -> None:  # fmt: skip
        self._native = native
        self.dtype = dtype
        self.dense_from_rows = dense_from_rows  # the smallest threshold among the products
        # Where the LM head multiplies through dense rows (its own threshold): from there the
        # stack leaves the head to model.logits.
        self.head_dense_from_rows = head_dense_from_rows
        # The pool the layer views below were taken from (held, so its identity cannot be reused).
        self._caches: tuple[Any, list[torch.Tensor], list[torch.Tensor]] | None = None

    @property
    def native(self) -> Any:
        return self._native

    @native.setter
    def native(self, native: Any) -> None:
        """A new native stack (weight_arena rebuilds it over the weights' new tensors) is
        handed the pool's views and fp8 scales afresh at its first step."""
        self._native = native
        self._caches = None

    def rows(self, ctx: StepContext, hidden: torch.Tensor, kv_pool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's rows as the stack runs them, (page table, lengths), when it takes the
        step; else None (the layers run it)."""
        meta = ctx.meta
        k = kv_pool.k(0)
        if not (
            ctx.rows == ctx.padded_rows > 0
            and ctx.rope.use_kernel
            and ctx.prepared_decode is None
            and hidden.dtype == self.dtype
            and (k.dtype == hidden.dtype or kv_fp8.is_fp8_kv(k))
            and k.is_contiguous()
            and (self.dense_from_rows is None or ctx.rows < self.dense_from_rows)
            and (meta.decode_page_table is None or meta.decode_page_table.dtype == torch.int32)
        ):
            return None
        return self._decode_rows(ctx)

    def _decode_rows(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(page table, lengths) of the step's rows as decode rows, or None. A decode step's
        are its own. A speculative verify step's (every extend a draft, short, its rows all
        sampled) are the decode rows' followed by the extend's decode-row form: each new
        token a row that sees the prefix and the tokens before it, whose keys and values
        the stack writes for every row of a layer before any row's attention. Verify steps
        left the stack for the layers' Python path (~12% of a plain step at batch 16 on the
        Zen 4 host, ~15% at 8); they stay on it up to VERIFY_ROWS extend rows (decode rows
        read a sequence's keys once a row, where the extend kernel reads them once for all
        its rows, so many drafted sequences are better off the stack: verify_on_stack)."""
        meta = ctx.meta
        if meta.num_decode == ctx.rows:
            if meta.decode_page_table is None:
                return None
            return meta.decode_page_table, meta.decode_seq_lens.to(torch.int32)
        short = ctx.prepared_extend
        if not (meta.verify_only and isinstance(short, cpu_attention.ShortExtend) and verify_on_stack(meta)):
            return None
        tables, lens = [short.page_table], [short.seq_lens]
        if meta.num_decode:
            tables.insert(0, meta.decode_page_table)
            lens.insert(0, meta.decode_seq_lens.to(torch.int32))
        width = max(t.shape[1] for t in tables)
        table = torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tables]) if len(tables) > 1 else tables[0]
        return table.to(torch.int32).contiguous(), torch.cat(lens) if len(lens) > 1 else lens[0]

    def forward(self, hidden: torch.Tensor, ctx: StepContext, kv_pool,
                rows: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """`rows`: what `rows()` gave for this step. (the final norm's rows, the float32
        logits) when the stack holds the model's head (set_head, see build) and the rows are
        below its dense threshold; else (the last layer's output, None), which the model
        normalizes itself."""
        meta = ctx.meta
        if self._caches is None or self._caches[0] is not kv_pool:
            n = self.native.num_layers
            self._caches = (kv_pool, [kv_pool.k(i) for i in range(n)], [kv_pool.v(i) for i in range(n)])
            # An fp8 pool's scales, held by the stack (calibration rewrites them in place).
            self.native.set_kv_scales(getattr(kv_pool, "scales", None))
        _, ks, vs = self._caches
        args = (hidden, ctx.rope.table, ctx.rope.positions, meta.slots, ks, vs, *rows)
        if self.native.has_head and (self.head_dense_from_rows is None or ctx.rows < self.head_dense_from_rows):
            return self.native.forward_logits(*args)
        return self.native.forward(*args), None


# A verify step runs on the stack where its drafted sequences bring at most this many rows
# in all (PREHEAT_VERIFY_STACK_ROWS overrides; 0 keeps verify steps off the stack). Measured
# on the Zen 4 host, bf16 SmolLM2, contexts ~300-600, 4-token drafts (5 rows a sequence):
# at batch 8 a step drafting 1 / 2 / 4 / 8 sequences took 18.3 / 21.6 / 28.0 / 43.4 ms off
# the stack and 15.3 / 18.5 / 25.2 / 40.3 ms on it (a plain step ~12); at batch 16, 1 / 4 / 8
# sequences 23.8 / 34.0 / 45.2 ms off, 21.7 / 30.6 / 45.3 on (plain ~18), and 16 sequences
# no faster on it.
VERIFY_ROWS = int(os.environ.get("PREHEAT_VERIFY_STACK_ROWS", "40"))


def verify_on_stack(meta: AttentionMetadata) -> bool:
    """Whether a verify step's extend rows are few enough to run as decode rows on the stack."""
    return 0 < sum(meta.extend_lens) <= VERIFY_ROWS


def _linear_spec(w: LinearWeight) -> tuple | None:
    if w.kind not in KINDS or w.packed is None:
        return None
    return (KINDS[w.kind], w.packed, w.scales, w.bias, w.out_features, w.activation_bits)


def build(model: DecoderModel) -> DecodeStack | None:
    """The model's stack, or None when a layer is not one the stack runs (logged at debug)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    kernels = getattr(model.backend, "kernels", None)
    if kernels is None or not hasattr(kernels, "decode_stack") or not model.layers:
        return None
    first = model.layers[0]
    heads, kv_heads, head_dim = first.attn.num_heads, first.attn.num_kv_heads, first.attn.head_dim
    dtype = model.embed.dtype
    probe_q = torch.empty((1, heads, head_dim), dtype=dtype)
    probe_k = torch.empty((1, 1, kv_heads, head_dim), dtype=dtype)
    if dtype not in (torch.bfloat16, torch.float32) or not cpu_attention.eligible(probe_q, probe_k):
        return None
    linears: list[tuple] = []
    thresholds: list[int] = []
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        if (
            layer.reduce is not None
            or layer.backend is not model.backend
            or layer.eps != first.eps
            or attn.qk_norm is not None
            or (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale) != (heads, kv_heads, head_dim, first.attn.scale)
            or not isinstance(mlp, DenseMLP)
        ):  # fmt: skip
            log.debug("decode stack: layer not stackable; the layers run one call at a time")
            return None
        for w in (attn.qkv, attn.o, mlp.gate_up, mlp.down):
            spec = _linear_spec(w)
            if spec is None or w.kernels is not kernels:
                return None
            linears.append(spec)
            if w.dense_from_rows is not None:
                thresholds.append(w.dense_from_rows)
        if layer.input_norm.dtype != dtype or layer.post_norm.dtype != dtype:
            return None
    native = kernels.decode_stack([layer.input_norm.contiguous() for layer in model.layers],
                                  [layer.post_norm.contiguous() for layer in model.layers], linears,
                                  first.eps, heads, kv_heads, head_dim, first.attn.scale)  # fmt: skip
    head = model.lm_head
    head_spec = _linear_spec(head) if isinstance(head, LinearWeight) else None
    head_from_rows = None
    if head_spec is not None and head.kernels is kernels and model.norm.dtype == dtype and model.norm.dim() == 1:
        native.set_head(model.norm.contiguous(), head_spec, model.spec.rms_norm_eps)
        head_from_rows = head.dense_from_rows
    return DecodeStack(native, dtype, min(thresholds) if thresholds else None, head_from_rows)
