"""Names the download tests share: the stand-ins' repositories and the embedded GGUF's path.

A module of its own rather than conftest.py: `from conftest import ...` picks whichever
conftest pytest imported last, which in a whole-suite run is another folder's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from preheat.engine.model.loader import DEFAULT_GGUF_NAME, DEFAULT_GGUF_PACKAGE

GGUF_REPO = "test-org/smollm2-gguf"
TINY_REPO = "test-org/tiny-llama"
PRIVATE_REPO = "test-org/private-tiny"
TOKEN = "hf_test_token"


def embedded_gguf() -> Path:
    folder = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE).submodule_search_locations[0]
    return Path(folder) / DEFAULT_GGUF_NAME
