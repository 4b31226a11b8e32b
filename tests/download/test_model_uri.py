"""--model values parsed without the network (engine/model/uri.py)."""

from __future__ import annotations

import pytest

from preheat.engine.config import ConfigError, EngineConfig
from preheat.engine.model.uri import HubModel, LocalModel, ModelURIError, S3Model, parse_model, served_name


def none_exist(_: str) -> bool:
    return False


@pytest.mark.parametrize("text, want", [
    (None, LocalModel(None)),
    ("org/name", HubModel("org/name")),
    ("hf://org/name", HubModel("org/name")),
    ("hf://org/name@v1.0", HubModel("org/name", "v1.0")),
    ("hf://org/name/q4/model.gguf", HubModel("org/name", None, "q4/model.gguf")),
    ("hf://org/name@0123abc/model.gguf", HubModel("org/name", "0123abc", "model.gguf")),
    ("s3://bucket/models/llama", S3Model("bucket", "models/llama")),
    ("s3://bucket/models/llama/", S3Model("bucket", "models/llama")),
    ("s3://bucket/m.gguf", S3Model("bucket", "m.gguf")),
    ("/models/llama", LocalModel("/models/llama")),
    ("relative/dir/x", LocalModel("relative/dir/x")),
])
def test_parse(text, want):
    assert parse_model(text, exists=none_exist) == want


def test_an_existing_local_path_wins_over_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_model("org/name") == LocalModel("org/name")


@pytest.mark.parametrize("text, says", [
    ("hf://org/name/model.bin", "must be a .gguf"),
    ("hf://justname", "expected hf://ORG/NAME"),
    ("s3://", "expected s3://BUCKET/PREFIX"),
    ("pvc://claim/path", "InferenceService form"),
    ("gs://bucket/x", "unsupported scheme"),
])
def test_refused(text, says):
    with pytest.raises(ModelURIError, match=says):
        parse_model(text, exists=none_exist)
    with pytest.raises(ConfigError, match=says):  # `preheat serve` refuses it before starting
        EngineConfig(model=text)


def test_served_names():
    assert served_name(HubModel("org/name", "main", "x.gguf")) == "org/name"
    assert served_name(S3Model("b", "models/llama-3")) == "llama-3"
    assert served_name(S3Model("b", "gguf/m.gguf")) == "m"
    assert served_name(LocalModel("/x")) is None
