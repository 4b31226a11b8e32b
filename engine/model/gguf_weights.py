"""A GGUF file's linear-layer matrices as int8 weights, straight from its quantized blocks.

With a block-quantized GGUF (the default, `--quantization auto`, or `int8`), the matrices are
not dequantized and re-quantized: our int8 format (engine/kernels/int8.py) is blocks of 32
codes with a float16 scale d and offset m each (w = d q + m), and GGUF's common formats map
onto it code for code:

- Q8_0 (d, 32 int8 q): d and m = -128 d over q + 128: exact;
- Q4_1 (d, m, 32 nibbles): as it is: exact;
- Q4_0 (d, 32 nibbles, w = d (q - 8)): m = -8 d: exact (a power-of-two multiple in float16);
- Q4_K (super-blocks of 256: float16 d and dmin, eight 6-bit scales and mins, 256 nibbles,
  w = d sc q - dmin mn per sub-block of 32): per sub-block d' = d sc and m' = -dmin mn,
  rounded to float16 (a relative error of at most 2^-11 of a scale, far below the 4-bit
  step; measured in benchmarks/results/int8_accuracy.md).

Codes of the three 4-bit formats are 0..15, so the kernel keeps them at 4 bits (`int8.pack`):
a decode step reads the bytes the file has. Other tensor types (float, Q5/Q6 K-quants, ...)
are dequantized with the gguf package and quantized to symmetric int8.

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
from preheat.engine.model.gguf_meta import read_gguf_metadata, read_gguf_tensors

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


def q4_0_blocks(raw: np.ndarray) -> int8.QuantizedWeight:
    """raw uint8 [N, K/32 * 18]: per block d (f16) and 16 bytes of nibbles (weights 0..15 in
    the low nibbles, 16..31 in the high ones); w = d * (q - 8)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 18)
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    qs = blocks[..., 2:]
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).reshape(n, -1)
    scales = torch.from_numpy(np.ascontiguousarray(d))
    return int8.QuantizedWeight(
        torch.from_numpy(np.ascontiguousarray(codes)), scales, (scales.to(torch.float32) * -8.0).to(torch.float16)
    )


def q4_k_blocks(raw: np.ndarray) -> int8.QuantizedWeight:
    """raw uint8 [N, K/256 * 144]: per super-block d, dmin (f16), 12 bytes of 6-bit scales
    and mins (gguf's `Q4_K.get_scale_min` unpacks them), 128 bytes of nibbles: chunk c of 32
    bytes holds sub-block 2c in its low nibbles and 2c + 1 in its high ones."""
    import gguf

    n = raw.shape[0]
    blocks = raw.reshape(-1, 144)  # [N * K/256, 144]
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=2).reshape(n, -1)
    scales = (d * sc.astype(np.float32)).astype(np.float16).reshape(n, -1)
    offsets = (-(dmin * mn.astype(np.float32))).astype(np.float16).reshape(n, -1)
    return int8.QuantizedWeight(*(torch.from_numpy(np.ascontiguousarray(t)) for t in (codes, scales, offsets)))


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


def read_int8_weights(path: str | Path, num_heads: int, num_kv_heads: int) -> dict[str, int8.QuantizedWeight]:
    """transformers-named int8 weights of every matrix in the file we multiply by. The file
    is memory-mapped and its tensor table read by `gguf_meta` (not gguf.GGUFReader, which
    decodes the whole vocabulary first: seconds at every start)."""
    import gguf

    arch = read_gguf_metadata(path, {"general.architecture"}).get("general.architecture")
    kinds = gguf.GGMLQuantizationType
    in_place = {kinds.Q4_0: q4_0_blocks, kinds.Q4_1: q4_1_blocks, kinds.Q4_K: q4_k_blocks, kinds.Q8_0: q8_0_blocks}
    out: dict[str, int8.QuantizedWeight] = {}
    requantized: set[str] = set()
    file = np.memmap(path, dtype=np.uint8, mode="r")
    for tensor in read_gguf_tensors(path):
        name = hf_name(tensor.name)
        if name is None:
            continue
        kind = kinds(tensor.tensor_type)
        rows = tensor.shape[0]
        raw = np.asarray(file[tensor.start : tensor.start + tensor.nbytes]).reshape(rows, -1)
        if kind in in_place:
            qw = in_place[kind](raw)
        else:  # float and other block types; a copy: F32 comes back as a view of the read-only map
            dense = np.array(gguf.quants.dequantize(raw, kind), dtype=np.float32, order="C")
            qw = int8.quantize(torch.from_numpy(dense))
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
