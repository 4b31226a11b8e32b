"""Router tests' fixtures: two real tiny-model engines (a decode step takes milliseconds),
shared by every router test of the session."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from router_engines import ENGINE_FLAGS
from serve_process import Server, start
from tiny_models import build_tiny_model

from preheat.engine.model.loader import DEFAULT_GGUF_NAME, DEFAULT_GGUF_PACKAGE


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE).submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=DEFAULT_GGUF_NAME)
    return build_tiny_model(tmp_path_factory.mktemp("router-tiny"), "llama", tokenizer)


@pytest.fixture(scope="session")
def engines(tmp_path_factory, tiny_model_dir) -> list[Server]:
    tmp = tmp_path_factory.mktemp("router-engines")
    servers = [start(tmp, ["--model", str(tiny_model_dir), *ENGINE_FLAGS], name=f"engine{i}")
               for i in range(2)]
    try:
        for s in servers:
            s.wait_ready(240)
        yield servers
    finally:
        for s in servers:
            s.stop()
