"""The router tests' engine settings, in a module of their own: `from conftest import ...`
picks whichever folder's conftest pytest imported last in a whole-suite run."""

from __future__ import annotations

TINY = "tiny"
ENGINE_FLAGS = ["--served-model-name", TINY, "--dtype", "float32", "--max-model-len", "256",
                "--max-total-tokens", "4096", "--page-size", "16", "--max-num-seqs", "8",
                "--log-level", "info"]
