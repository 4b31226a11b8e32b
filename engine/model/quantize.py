"""`--quantization`: which quantization an engine runs (`effective_quantization`: auto picks a
GGUF's own blocks), and with int8 which weights become int8, and from what.

Every matrix the forward pass multiplies by (q/k/v/o, gate/up/down, the LM head) is stored
as int8 (engine/kernels/int8.py); norms, biases and the embedding lookup stay in the model
dtype, and so do the KV cache and the activations. Mixture-of-experts experts and routers
are not quantized (no int8 grouped-experts kernel yet). A GGUF source gives its quantized blocks
directly (engine/model/gguf_weights.py); any other source is quantized here, symmetric,
per block of 32, when the model builder reads it. A matrix whose input size is not a
multiple of 32 stays unquantized.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from preheat.engine.kernels import int8
from preheat.engine.model.spec import ModelSpec

log = logging.getLogger(__name__)

_LAYER_MATRICES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def matrix_names(spec: ModelSpec) -> list[str]:
    """Pure: transformers names of the matrices the forward pass multiplies by."""
    names = [f"model.layers.{i}.{m}.weight" for i in range(spec.num_layers) for m in _LAYER_MATRICES]
    return names + ["lm_head.weight"]


# general.file_type values of an unquantized GGUF (llama.cpp's LlamaFileType): ALL_F32,
# MOSTLY_F16, MOSTLY_BF16. Every other value is a block-quantized file.
FLOAT_FILE_TYPES = frozenset({0, 1, 32})


def effective_quantization(requested: str | None, source: str | None, kernels_read_blocks: bool) -> str | None:
    """The quantization an engine runs: "int8" (the int8 format, a GGUF's blocks in place)
    or None (the checkpoint in --dtype). `requested` is --quantization (None = "auto");
    `source` the local model (a .gguf file or a directory); `kernels_read_blocks` whether
    this device and dtype have the CPU kernels that read int8/4-bit blocks in place —
    elsewhere a quantized matrix is dequantized to float32 once (`int8-reference`), slower
    than serving --dtype, so auto dequantizes there."""
    if requested == "none":
        return None
    if requested not in (None, "auto"):
        return requested
    if not kernels_read_blocks or source is None or Path(source).suffix != ".gguf":
        return None
    from preheat.engine.model.gguf_meta import read_gguf_metadata

    file_type = read_gguf_metadata(source, {"general.file_type"}).get("general.file_type")
    return "int8" if file_type is not None and int(file_type) not in FLOAT_FILE_TYPES else None


def quantize_weights(
    hf: Mapping[str, torch.Tensor], spec: ModelSpec, source: str, method: str
) -> Int8Checkpoint:
    """The transformers-named weights with every matrix int8, as a mapping that quantizes
    each matrix when the model builder asks for it: a tensor-parallel worker reading its
    checkpoint tensor by tensor (engine/model/checkpoint.py) keeps doing so, and every
    rank quantizes the WHOLE matrix before its Sharder cuts its slice, so the slices are
    exactly the single-rank engine's. The LM head of a tied model comes back as
    "lm_head.weight" (the embedding tensor stays for the lookup)."""
    if method != "int8":
        raise ValueError(f"unknown quantization {method!r}; supported: int8")
    from_file: dict[str, int8.QuantizedWeight] = {}
    if Path(source).suffix == ".gguf":
        from preheat.engine.model.gguf_weights import read_int8_weights

        started = time.monotonic()
        from_file = read_int8_weights(source, spec.num_heads, spec.num_kv_heads)
        if "lm_head.weight" not in from_file and spec.tie_word_embeddings:
            if "model.embed_tokens.weight" in from_file:
                from_file["lm_head.weight"] = from_file["model.embed_tokens.weight"]
        log.info("int8: %d matrices from the file's blocks in %.1fs", len(from_file), time.monotonic() - started)
    return Int8Checkpoint(hf, spec, from_file)


class Int8Checkpoint(Mapping[str, Any]):
    """`hf` with its matrices int8 (see quantize_weights): the file's blocks where a GGUF
    gave them, else quantized on access. The LM head is kept once quantized (the builder
    looks at it twice); every other matrix is read once."""

    def __init__(self, hf: Mapping[str, torch.Tensor], spec: ModelSpec,
                 from_file: dict[str, int8.QuantizedWeight]) -> None:  # fmt: skip
        self.hf, self.from_file = hf, from_file
        self.matrices = set(matrix_names(spec))
        self._head: Any = None
        self.kept: list[str] = []

    def __getitem__(self, name: str) -> Any:
        if name not in self.matrices:
            return self.hf[name]
        if name == "lm_head.weight" and self._head is not None:
            return self._head
        out = self._quantized(name)
        if name == "lm_head.weight":
            self._head = out
        return out

    def _quantized(self, name: str) -> Any:
        if name in self.from_file:
            return self.from_file[name]
        if name in self.hf:
            dense = self.hf[name]
        elif name == "lm_head.weight":  # tied: the LM head is the embedding, quantized
            dense = self.hf["model.embed_tokens.weight"]
        else:
            raise KeyError(name)
        if dense.shape[1] % int8.BLOCK:
            if not self.kept:
                log.warning("int8: a matrix with an input size not divisible by %d stays unquantized: %s",
                            int8.BLOCK, name)  # fmt: skip
            self.kept.append(name)
            return dense
        return int8.quantize(dense)

    def __contains__(self, name: object) -> bool:
        if name == "lm_head.weight":
            return name in self.hf or name in self.from_file or "model.embed_tokens.weight" in self.hf
        return name in self.hf or name in self.from_file

    def __iter__(self) -> Iterator[str]:
        names = list(self.hf)
        if "lm_head.weight" in self and "lm_head.weight" not in self.hf:
            names.append("lm_head.weight")
        return iter(names)

    def __len__(self) -> int:
        return sum(1 for _ in self)
