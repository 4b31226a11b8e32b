"""A Hugging Face directory's weight files, and their tensors read one at a time, when asked for.

The engine reads a checkpoint through `LazyCheckpoint`: the model builder asks for each
tensor it needs, so what a start never uses is never read — a restart that takes its
matrices prepared from the weight cache (engine/model/prepared_cache.py) reads only the
embedding and the norms. A tensor-parallel worker reads from the directory rank 0 loaded
(the model directory or its weight-cache entry) the same way, so it holds one full tensor
on the host at a time (then only its slice, on its device), never N copies of the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


def weight_files(path: Path) -> list[Path]:
    """The safetensors files that make up the checkpoint: those a sharded checkpoint's
    `model.safetensors.index.json` names, else `model.safetensors`, else every
    *.safetensors file. Going by the index keeps out stray files that share the directory
    (Mistral repositories also ship `consolidated.safetensors`, the same weights under other
    names)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{path}: shards named in {index.name} are missing: {', '.join(missing)}")
        if files:
            return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weight files")
    return files


class LazyCheckpoint(Mapping[str, torch.Tensor]):
    """transformers names -> tensors in `dtype`, read from safetensors files on access."""

    def __init__(self, directory: str | Path, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._files: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        for f in weight_files(Path(directory)):
            handle = safe_open(str(f), framework="pt")
            self._files[str(f)] = handle
            for name in handle.keys():
                self._where[name] = str(f)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._files[self._where[name]].get_tensor(name)
        return t if t.dtype == self.dtype else t.to(self.dtype)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        self._files.clear()
