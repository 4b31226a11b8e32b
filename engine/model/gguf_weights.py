"""A GGUF file's linear-layer matrices as int8 weights, straight from its quantized blocks.

With `--quantization int8` and a GGUF model, the matrices are not dequantized and
re-quantized: GGUF's Q8_0 and Q4_1 blocks (32 weights, a float16 scale, Q4_1 also a float16
minimum) are exactly our int8 format's blocks (engine/kernels/int8.py), so the kernel reads
the very weights the file holds. Other tensor types (float, K-quants, ...) are dequantized
with the gguf package and quantized to symmetric int8.

transformers un-permutes the q and k rows of a "llama" GGUF on load (llama.cpp's converter
permutes them for its rotary layout); the same row permutation is applied here, so these
weights line up with the dequantized ones everything else reads.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from preheat.engine.kernels import int8

log = logging.getLogger(__name__)

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str | None:
    """Pure: the transformers name of a GGUF matrix we multiply by, or None."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def q4_1_blocks(raw: np.ndarray) -> int8.QuantizedWeight:
    """raw uint8 [N, K/32 * 20]: per block d (f16), m (f16), 16 bytes of nibbles (weights
    0..15 in the low nibbles, 16..31 in the high ones)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 20)
    dm = blocks[..., :4].copy().view(np.float16)  # [N, KB, 2]
    qs = blocks[..., 4:]
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).reshape(n, -1)
    return int8.QuantizedWeight(
        torch.from_numpy(np.ascontiguousarray(codes)),
        torch.from_numpy(np.ascontiguousarray(dm[..., 0])),
        torch.from_numpy(np.ascontiguousarray(dm[..., 1])),
    )


def q8_0_blocks(raw: np.ndarray) -> int8.QuantizedWeight:
    """raw uint8 [N, K/32 * 34]: per block d (f16) and 32 int8 weights; w = d * q."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 34)
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    q = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128
    scales = torch.from_numpy(np.ascontiguousarray(d))
    return int8.QuantizedWeight(
        torch.from_numpy(q.astype(np.uint8).reshape(n, -1)), scales, (scales.to(torch.float32) * -128.0).to(torch.float16)
    )


def unpermute_rows(qw: int8.QuantizedWeight, n_head: int) -> int8.QuantizedWeight:
    """transformers' reverse permutation of q/k rows (rows [n_head, dim, 2] -> [n_head, 2, dim])."""
    n = qw.shape[0]
    order = torch.arange(n).reshape(n_head, n // n_head // 2, 2).transpose(1, 2).reshape(n)
    return int8.QuantizedWeight(qw.codes[order], qw.scales[order], qw.offsets[order])


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if value.dtype == np.uint8 else value.tolist()[0]


def read_int8_weights(path: str | Path, num_heads: int, num_kv_heads: int) -> dict[str, int8.QuantizedWeight]:
    """transformers-named int8 weights of every matrix in the file we multiply by."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    kinds = gguf.GGMLQuantizationType
    out: dict[str, int8.QuantizedWeight] = {}
    requantized: set[str] = set()
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        kind = tensor.tensor_type
        if kind == kinds.Q4_1:
            qw = q4_1_blocks(np.asarray(tensor.data))
        elif kind == kinds.Q8_0:
            qw = q8_0_blocks(np.asarray(tensor.data))
        else:
            dense = gguf.quants.dequantize(np.asarray(tensor.data), kind)
            qw = int8.quantize(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)))
            requantized.add(kind.name)
        if arch == "llama" and ".attn_q." in tensor.name:
            qw = unpermute_rows(qw, num_heads)
        elif arch == "llama" and ".attn_k." in tensor.name:
            qw = unpermute_rows(qw, num_kv_heads)
        out[name] = qw
    if requantized:
        log.info("int8: quantized %s tensors of %s (no int8 kernel reads them as they are)",
                 ", ".join(sorted(requantized)), Path(path).name)
    return out
