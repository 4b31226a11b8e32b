"""Fixtures for the model-download tests: the hub stand-in and moto's S3 server (both test
stand-ins, on 127.0.0.1), serving the embedded SmolLM2 GGUF and a tiny safetensors model."""

from __future__ import annotations

from pathlib import Path

import pytest
from download_repos import GGUF_REPO, PRIVATE_REPO, TINY_REPO, TOKEN, embedded_gguf
from standins.hub_server import HubStandIn
from standins.s3_server import S3StandIn
from tiny_models import build_tiny_model

from preheat.engine.model.loader import DEFAULT_GGUF_NAME


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    gguf = embedded_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", tokenizer)


@pytest.fixture(scope="session")
def hub(tiny_dir, tmp_path_factory):
    readme = tmp_path_factory.mktemp("readme") / "README.md"
    readme.write_text("# a GGUF repository\n")
    tiny_files = {p.name: p for p in sorted(tiny_dir.iterdir()) if p.is_file()}
    with HubStandIn() as h:
        h.add(GGUF_REPO, {DEFAULT_GGUF_NAME: embedded_gguf(), "README.md": readme})
        h.add(TINY_REPO, tiny_files)
        h.add(PRIVATE_REPO, tiny_files, token=TOKEN)
        yield h


@pytest.fixture
def hub_endpoint(hub, monkeypatch):
    """huggingface_hub reads HF_ENDPOINT once, at import: point this process at the stand-in
    (a `preheat serve` child gets HF_ENDPOINT in its environment instead)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return hub.url


@pytest.fixture(scope="session")
def s3(tiny_dir):
    with S3StandIn() as s:
        s.put_folder("models", "tiny-llama", tiny_dir)
        s.put_file("models", f"gguf/{DEFAULT_GGUF_NAME}", embedded_gguf())
        yield s


@pytest.fixture
def s3_env(s3, monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    return s3
