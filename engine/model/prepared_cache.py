"""The model's matrices in the form the CPU kernels multiply by, kept in the weight cache so
a restart reads them instead of making them again.

On the CPU kernels every matrix is *prepared* at load (engine/kernels/linear.py): a bfloat16
weight is re-laid for vdpbf16ps, an int8 weight (a GGUF's Q4_1 / Q8_0 blocks, or the
checkpoint quantized) is unpacked from the file's blocks and packed again for vpdpwssd.
For the embedded model that is ~0.7 s of every start (issue 27: restart to ready), repeated
to the byte each time. The first start writes the prepared matrices here (safetensors, no
pickle: the cache may sit on a volume other pods write); a later start with the same
weights, dtype, quantization and preparing code reads them back, memory-mapped, and
never reads the checkpoint's matrices at all (the loader reads tensors lazily).

An entry's key covers everything its bytes depend on: the weights' id (the source's full
sha256, engine/model/weights_id.py), the activations' dtype, the quantization, and a hash
of the code that reads, fuses and packs the matrices — a change there makes a new key, so
a stale layout is never read. An entry that is damaged or does not fit the model (shapes,
dtypes, names) is ignored with a log line and rebuilt; a cache that cannot be written
costs only the time this saves. Single-rank dense models only: tensor-parallel shards and
experts are prepared as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from preheat.engine.kernels import linear
from preheat.engine.kernels.linear import LinearWeight
from preheat.engine.model.spec import ModelSpec
from preheat.engine.model.weights_id import write_entry

log = logging.getLogger(__name__)

FORMAT = "1"
WEIGHTS_FILE = "prepared.safetensors"
DONE = "DONE"
_ENGINE = Path(__file__).resolve().parents[1]
PREPARING_SOURCES = [_ENGINE / "kernels" / "int8.py", _ENGINE / "kernels" / "linear.py"] + [
    _ENGINE / "model" / f"{name}.py" for name in ("gguf_weights", "quantize", "build", "sharding")
]


def preparing_code_hash() -> str:
    """sha256 over the sources that decide a prepared matrix's bytes: the checkpoint readers
    (GGUF blocks, int8), the fusion of q/k/v and gate/up, and the packing."""
    h = hashlib.sha256(FORMAT.encode())
    for source in PREPARING_SOURCES:
        h.update(source.read_bytes())
    return h.hexdigest()


def entry_key(weights_id: str, dtype: torch.dtype, quantization: str | None, code_hash: str) -> str:
    """Pure: the entry's folder name for these inputs."""
    parts = json.dumps([weights_id, str(dtype), quantization or "none", code_hash])
    return hashlib.sha256(parts.encode()).hexdigest()[:40]


def entry_path(cache_root: Path, weights_id: str, dtype: torch.dtype, quantization: str | None) -> Path:
    return cache_root / "prepared" / entry_key(weights_id, dtype, quantization, preparing_code_hash())


def linear_names(spec: ModelSpec) -> list[str]:
    """Pure: the model's matrices by the part that holds them, as `build_model` takes them."""
    names = []
    for i in range(spec.num_layers):
        names += [f"layers.{i}.attn.qkv", f"layers.{i}.attn.o", f"layers.{i}.mlp.gate_up", f"layers.{i}.mlp.down"]
    return [*names, "lm_head"]


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Pure: [out, in] of each matrix in `linear_names`."""
    hd, hidden, inter = spec.head_dim, spec.hidden_size, spec.intermediate_size
    per_layer = {
        "attn.qkv": ((spec.num_heads + 2 * spec.num_kv_heads) * hd, hidden),
        "attn.o": (hidden, spec.num_heads * hd),
        "mlp.gate_up": (2 * inter, hidden),
        "mlp.down": (hidden, inter),
    }
    shapes = {f"layers.{i}.{part}": shape for i in range(spec.num_layers) for part, shape in per_layer.items()}
    return shapes | {"lm_head": (spec.vocab_size, hidden)}


def model_linears(model: Any) -> dict[str, LinearWeight]:
    """The built model's matrices by the names of `linear_names`."""
    out = {}
    for i, layer in enumerate(model.layers):
        out |= {f"layers.{i}.attn.qkv": layer.attn.qkv, f"layers.{i}.attn.o": layer.attn.o,
                f"layers.{i}.mlp.gate_up": layer.mlp.gate_up, f"layers.{i}.mlp.down": layer.mlp.down}
    return out | {"lm_head": model.lm_head}


def read(entry: Path, spec: ModelSpec, dtype: torch.dtype, kernels: Any,
         dense_from_rows: dict[str, int] | None, activation_bits: int = 16) -> dict[str, LinearWeight] | None:  # fmt: skip
    """The prepared matrices of a complete entry, or None (no entry, or one that does not
    fit: logged, and the caller prepares them again)."""
    if not (entry / DONE).is_file():
        return None
    started = time.monotonic()
    try:
        from safetensors import safe_open

        with safe_open(str(entry / WEIGHTS_FILE), framework="pt") as f:
            kinds = json.loads((f.metadata() or {}).get("kinds", "{}"))
            shapes = expected_shapes(spec)
            if set(kinds) != set(shapes):
                raise ValueError("the entry holds other matrices than this model's")
            tensors: dict[str, dict[str, torch.Tensor]] = {name: {} for name in kinds}
            for key in f.keys():
                name, _, part = key.rpartition(".")
                if name not in tensors:
                    raise ValueError(f"unexpected tensor {key}")
                tensors[name][part] = f.get_tensor(key)
        out = {name: linear.restore(kinds[name], *shapes[name], tensors[name], dtype, kernels, dense_from_rows,
                                    activation_bits)
               for name in linear_names(spec)}  # fmt: skip
    except Exception as exc:  # a damaged or foreign entry is rebuilt, never fatal
        log.warning("prepared weights: entry %s unusable (%s: %s); preparing them again", entry,
                    type(exc).__name__, exc)  # fmt: skip
        return None
    log.info("prepared weights: read %d matrices from %s in %.2fs", len(out), entry, time.monotonic() - started)
    return out


def write(entry: Path, model: Any, replace_unusable: bool = False) -> bool:
    """Keeps the built model's prepared matrices in `entry` (written whole under a temp name,
    then renamed; a complete entry another process wrote meanwhile is kept, unless `read`
    found it unusable: `replace_unusable`). False, with a log line, when the model has
    matrices that are not packed or the cache is not writable."""
    linears = model_linears(model)
    if any(w.kind not in linear.PACKED_TENSORS for w in linears.values()):
        return False
    started = time.monotonic()
    tensors = {f"{name}.{part}": t.contiguous() for name, w in linears.items() for part, t in linear.stored(w).items()}
    kinds = json.dumps({name: w.kind for name, w in linears.items()})

    def fill(tmp: Path) -> None:
        from safetensors.torch import save_file

        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT, "kinds": kinds})
        (tmp / DONE).write_text(json.dumps({"created": time.time()}))

    try:
        write_entry(entry, fill, replace_unusable)
    except OSError as exc:
        if (entry / DONE).is_file():
            return True  # written meanwhile by another process
        log.warning("prepared weights: could not write %s (%s); the next start prepares them again", entry, exc)
        return False
    log.info("prepared weights: kept %d matrices in %s in %.2fs", len(linears), entry, time.monotonic() - started)
    return True
