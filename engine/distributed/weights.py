"""A worker rank's view of the checkpoint: tensors read one at a time, when asked for.

Rank 0 reads the checkpoint as a single-process engine does (and converts a GGUF into the
weight cache). A worker reads from the Hugging Face directory rank 0 loaded — the model
directory or that weight-cache entry — tensor by tensor, so it holds one full tensor on the
host at a time (then only its slice, on its device), never N copies of the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from preheat.engine.model.loader import weight_files


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
