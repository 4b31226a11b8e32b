"""The converted-weight cache may sit on a volume that many pods share and fill at once:
an entry is only ever visible complete, and a complete entry another pod may be reading is
never replaced — unless this process found it unusable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from preheat.engine.model import loader
from preheat.engine.model.loader import LoadedModel
from preheat.engine.model.spec import ModelSpec


class Saves:
    """Stands in for a transformers config or tokenizer: writes one file."""

    def __init__(self, name: str) -> None:
        self.name = name

    def save_pretrained(self, directory) -> None:
        Path(directory, self.name).write_text("{}")


def converted(writer: str) -> LoadedModel:
    spec = ModelSpec.from_hf_config(LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
                                                intermediate_size=32, vocab_size=32))
    return LoadedModel(
        hf_config=Saves("config.json"), spec=spec, tokenizer=Saves("tokenizer.json"),
        weights={"w": torch.zeros(2)}, source=writer, served_name="m", from_cache=False,
    )


def writer_of(entry: Path) -> str:
    return json.loads((entry / "DONE").read_text())["source"]


def test_an_entry_is_written_whole(tmp_path):
    entry = tmp_path / "key"
    loader._write_cache_entry(entry, converted("pod-a"))
    assert writer_of(entry) == "pod-a"
    assert {p.name for p in entry.iterdir()} == {"DONE", "model.safetensors", "config.json", "tokenizer.json"}
    assert [p.name for p in tmp_path.iterdir()] == ["key"]  # no temp dirs left behind


def test_a_complete_entry_written_meanwhile_by_another_pod_is_kept(tmp_path):
    entry = tmp_path / "key"
    loader._write_cache_entry(entry, converted("pod-a"))
    loader._write_cache_entry(entry, converted("pod-b"))
    assert writer_of(entry) == "pod-a"
    assert [p.name for p in tmp_path.iterdir()] == ["key"]


def test_an_entry_this_process_found_unusable_is_replaced(tmp_path):
    entry = tmp_path / "key"
    loader._write_cache_entry(entry, converted("pod-a"))
    loader._write_cache_entry(entry, converted("pod-b"), replace_damaged=True)
    assert writer_of(entry) == "pod-b"


def test_an_incomplete_entry_is_replaced(tmp_path):
    entry = tmp_path / "key"
    entry.mkdir()
    (entry / "model.safetensors").write_text("half")
    loader._write_cache_entry(entry, converted("pod-b"))
    assert writer_of(entry) == "pod-b"


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(loader, "save_file", full_disk)
    with pytest.raises(OSError):
        loader._write_cache_entry(tmp_path / "key", converted("pod-a"))
    assert list(tmp_path.iterdir()) == []
