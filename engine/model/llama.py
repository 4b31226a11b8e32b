"""Our forward pass for Llama-family causal LMs (Llama, Qwen2, Mistral shapes) over the
paged KV pool.

Tokens of all sequences in a step are laid back to back ("flat"): decode rows first (one
token per sequence), then the new tokens of extending sequences. Linear layers run on all of
them at once; only attention looks at which sequence a row belongs to. The numerics follow
transformers' Llama (RMSNorm in float32, RoPE in float32 cast to the model dtype) so greedy
output matches it token for token in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from preheat.engine.kernels import attention
from preheat.engine.model.spec import ModelSpec


@dataclass
class AttentionMetadata:
    """Where each row of a flat batch reads and writes KV."""

    positions: torch.Tensor  # int64 [T]
    slots: torch.Tensor  # int64 [T]
    num_decode: int  # rows [0, num_decode) are decode tokens, one per sequence
    decode_page_table: torch.Tensor | None  # int32 [num_decode, max_pages]
    decode_seq_lens: torch.Tensor | None  # int32 [num_decode], including the new token
    extend_page_table: torch.Tensor | None  # int32 [num_extend_seqs, max_pages]
    extend_prefix_lens: list[int]
    extend_lens: list[int]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalise in float32, cast back, then scale. torch's
    fused rms_norm gives bit-identical results with half the kernel launches."""
    return weight * F.rms_norm(x.to(torch.float32), x.shape[-1:], eps=eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin`, where rotate_half(x) = [-x2, x1].
    Rolling x by half gives [x2, x1]; the sign lives in `signed_sin` = [-sin, sin] instead
    (negation is exact, so the result is bit-identical with two kernels fewer per layer)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class RotaryEmbedding:
    """cos and signed sin (see apply_rope) per position, computed the way transformers
    computes cos/sin (float32, then cast)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype) -> None:
        self.inv_freq = inv_freq.to(torch.float32)
        self.scaling = attention_scaling
        self.dtype = dtype

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.scaling).to(self.dtype)
        sin = (freqs.sin() * self.scaling).to(self.dtype)
        signed_sin = torch.cat((-sin, sin), dim=-1)
        return cos[:, None, :], signed_sin[:, None, :]  # broadcast over heads


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


class LlamaModel:
    """Holds weights as plain tensors (fused qkv and gate/up) and runs the forward pass."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], rope: RotaryEmbedding) -> None:
        self.spec = spec
        self.rope = rope
        self.embed = weights["embed"]
        self.norm = weights["norm"]
        self.lm_head = weights["lm_head"]
        self.layers = [
            {name: weights.get(f"layers.{i}.{name}") for name in _LAYER_TENSORS}
            for i in range(spec.num_layers)
        ]
        # What one decode step reads from memory: every matrix and norm once (the embedding
        # is a lookup of a few rows; tied, it is read in full as the LM head).
        self.step_weight_bytes = sum(t.numel() * t.element_size() for k, t in weights.items() if k != "embed")
        self.scale = spec.head_dim**-0.5
        self.pad_rows = self.embed.device.type == "cpu"  # cuBLAS has no per-shape build cost

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_pool) -> torch.Tensor:
        """Returns final hidden states [T, hidden] (after the last norm)."""
        spec = self.spec
        rows = input_ids.shape[0]
        pad = padded_rows(rows) - rows if self.pad_rows else 0
        positions = meta.positions
        if pad:  # padding rows run through the matmuls only; attention never sees them
            input_ids = F.pad(input_ids, (0, pad))
            positions = F.pad(positions, (0, pad))
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rope(positions)
        q_size = spec.num_heads * spec.head_dim
        kv_size = spec.num_kv_heads * spec.head_dim
        heads_qk = spec.num_heads + spec.num_kv_heads
        nd = meta.num_decode
        prepared = (
            attention.prepare_decode(meta.decode_page_table, meta.decode_seq_lens, kv_pool.page_size)
            if nd
            else None
        )
        prepared_extend = (
            attention.prepare_extend(
                meta.extend_page_table, meta.extend_prefix_lens, meta.extend_lens, kv_pool.page_size
            )
            if meta.extend_lens
            else None
        )
        for index, w in enumerate(self.layers):
            residual = h
            x = rms_norm(h, w["input_norm"], spec.rms_norm_eps)
            qkv = F.linear(x, w["qkv"], w["qkv_bias"])
            # q and k sit side by side in qkv: rotate them in one pass (half the ops per layer).
            qk = apply_rope(qkv[:, : q_size + kv_size].view(-1, heads_qk, spec.head_dim), cos, sin)
            q, k = qk[:rows].split([spec.num_heads, spec.num_kv_heads], dim=1)
            v = qkv[:rows, q_size + kv_size :].view(-1, spec.num_kv_heads, spec.head_dim)
            k_cache, v_cache = kv_pool.k(index), kv_pool.v(index)
            attention.write_kv(k_cache, v_cache, k, v, meta.slots)
            if nd == q.shape[0]:
                o = attention.decode_attention(
                    q, k_cache, v_cache, meta.decode_page_table, meta.decode_seq_lens, self.scale, prepared
                )
            elif nd == 0:
                o = attention.extend_attention(
                    q, k_cache, v_cache, meta.extend_page_table,
                    meta.extend_prefix_lens, meta.extend_lens, self.scale, prepared_extend,
                )
            else:
                o = torch.cat(
                    (
                        attention.decode_attention(
                            q[:nd], k_cache, v_cache, meta.decode_page_table,
                            meta.decode_seq_lens, self.scale, prepared,
                        ),
                        attention.extend_attention(
                            q[nd:], k_cache, v_cache, meta.extend_page_table,
                            meta.extend_prefix_lens, meta.extend_lens, self.scale, prepared_extend,
                        ),
                    )
                )
            o = o.reshape(rows, q_size)
            if pad:
                o = F.pad(o, (0, 0, 0, pad))
            h = residual + F.linear(o, w["o"])
            residual = h
            x = rms_norm(h, w["post_norm"], spec.rms_norm_eps)
            gate, up = F.linear(x, w["gate_up"]).chunk(2, dim=-1)
            h = residual + F.linear(F.silu(gate) * up, w["down"])
        return rms_norm(h[:rows], self.norm, spec.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        pad = padded_rows(rows) - rows if self.pad_rows else 0
        if pad:
            hidden = F.pad(hidden, (0, 0, 0, pad))
        return F.linear(hidden, self.lm_head)[:rows].to(torch.float32)


_LAYER_TENSORS = ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down")
