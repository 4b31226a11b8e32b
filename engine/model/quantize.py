"""`--quantization int8`: which weights become int8, and from what.

Every matrix the forward pass multiplies by (q/k/v/o, gate/up/down, the LM head) is stored
as int8 (engine/kernels/int8.py); norms, biases and the embedding lookup stay in the model
dtype, and so do the KV cache and the activations. Mixture-of-experts experts and routers
are not quantized (no int8 grouped-experts kernel yet). A GGUF source gives its quantized blocks
directly (engine/model/gguf_weights.py); any other source is quantized here, symmetric,
per block of 32. A matrix whose input size is not a multiple of 32 stays unquantized.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from preheat.engine.config import QUANTIZATIONS
from preheat.engine.kernels import int8
from preheat.engine.model.spec import ModelSpec

log = logging.getLogger(__name__)

_LAYER_MATRICES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def matrix_names(spec: ModelSpec) -> list[str]:
    """Pure: transformers names of the matrices the forward pass multiplies by."""
    names = [f"model.layers.{i}.{m}.weight" for i in range(spec.num_layers) for m in _LAYER_MATRICES]
    return names + ["lm_head.weight"]


def quantize_weights(
    hf: dict[str, torch.Tensor], spec: ModelSpec, source: str, method: str
) -> dict[str, Any]:
    """A copy of the transformers-named weights with every matrix int8. The LM head of a
    tied model comes back as "lm_head.weight" (the embedding tensor stays for the lookup)."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(QUANTIZATIONS)}")
    started = time.monotonic()
    from_file: dict[str, int8.QuantizedWeight] = {}
    if Path(source).suffix == ".gguf":
        from preheat.engine.model.gguf_weights import read_int8_weights

        from_file = read_int8_weights(source, spec.num_heads, spec.num_kv_heads)
        if "lm_head.weight" not in from_file and spec.tie_word_embeddings:
            if "model.embed_tokens.weight" in from_file:
                from_file["lm_head.weight"] = from_file["model.embed_tokens.weight"]
    out: dict[str, Any] = dict(hf)
    kept: list[str] = []
    counts = {"file": 0, "quantized": 0}
    for name in matrix_names(spec):
        if name in from_file:
            out[name] = from_file[name]
            counts["file"] += 1
            continue
        dense = hf.get(name)
        if dense is None and name == "lm_head.weight":
            dense = hf["model.embed_tokens.weight"]
        if dense is None:  # a mixture-of-experts layer: its experts stay in --dtype
            continue
        if dense.shape[1] % int8.BLOCK:
            kept.append(name)
            continue
        out[name] = int8.quantize(dense)
        counts["quantized"] += 1
    if kept:
        log.warning("int8: %d matrices have an input size not divisible by %d and stay unquantized: %s",
                    len(kept), int8.BLOCK, ", ".join(kept[:3]) + (" ..." if len(kept) > 3 else ""))
    log.info("int8: %d matrices from the file's blocks, %d quantized, in %.1fs",
             counts["file"], counts["quantized"], time.monotonic() - started)
    return out
