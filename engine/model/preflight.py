"""Is a --model something we run? Answered from config.json or the GGUF header alone.

Kept free of torch and transformers so `preheat serve` can refuse an unsupported model in
milliseconds, before its server starts, with the same message the loader would give.
"""

from __future__ import annotations

import json
from pathlib import Path

from preheat.engine.model.families import family_for, gguf_model_type
from preheat.engine.model.gguf_meta import gguf_identity


def check_supported(model: str | None) -> str | None:
    """The model_type a --model will load as, refusing an unsupported family (or a GGUF
    transformers cannot read whole) with UnsupportedModelError. Reads only config.json or
    the GGUF header: milliseconds, so `preheat serve` checks before it starts. None when
    there is nothing to check yet (the embedded default, or a path the loader will refuse)."""
    if model is None:
        return None
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        try:
            model_type = json.loads((path / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            return None  # unreadable: transformers' own error says why, at load
        return family_for(model_type).model_type
    if path.is_file() and path.suffix == ".gguf":
        try:
            identity = gguf_identity(path)
        except (OSError, ValueError):
            return None  # not GGUF after all: transformers' reader says why, at load
        return gguf_model_type(*identity)
    return None
