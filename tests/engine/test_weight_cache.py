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


# --------------------------------------------------------------------------- weights identity


def fine_tune_of(base: Path, target: Path) -> Path:
    """A copy of a checkpoint whose last byte differs: same shapes, same leading tensors."""
    import shutil

    shutil.copytree(base, target)
    weights = next(target.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    return target


def test_a_fine_tune_sharing_leading_tensors_has_another_weights_id(tiny_llama_dir, tmp_path):
    tuned = fine_tune_of(tiny_llama_dir, tmp_path / "tuned")
    cache = tmp_path / "cache"
    base_id = loader.weights_id(sorted(tiny_llama_dir.glob("*.safetensors")), cache)
    tuned_id = loader.weights_id(sorted(tuned.glob("*.safetensors")), cache)
    assert base_id != tuned_id
    # The first MiB of each file (the identity before) is the same for both.
    first_mib = [f.read_bytes()[: 1 << 20] for f in (next(tiny_llama_dir.glob("*.safetensors")),
                                                     next(tuned.glob("*.safetensors")))]
    assert first_mib[0] == first_mib[1]
    assert loader.load_model(str(tuned), torch.float32, str(cache)).weights_id == tuned_id


def test_the_weights_id_is_hashed_once_and_kept_in_the_weight_cache(tiny_llama_dir, tmp_path, monkeypatch):
    from preheat.engine.model import weights_id as wid

    model = fine_tune_of(tiny_llama_dir, tmp_path / "model")
    files = sorted(model.glob("*.safetensors"))
    hashed = []
    real = wid.file_digest
    monkeypatch.setattr(wid, "file_digest", lambda p: hashed.append(p) or real(p))
    cache = tmp_path / "cache"
    first = wid.weights_id(files, cache)
    second = wid.weights_id(files, cache)
    assert first == second and len(hashed) == len(files)  # the second start read it back
    assert wid.sidecar_path(files, cache).is_file()
    assert not any(p.name.endswith(".json") and "weights-id" in p.name for p in model.iterdir())
    # Changed weights (a new mtime and content) are hashed again.
    data = bytearray(files[0].read_bytes())
    data[-2] ^= 0x01
    files[0].write_bytes(bytes(data))
    third = wid.weights_id(files, cache)
    assert third != first and len(hashed) == 2 * len(files)
    # Without a weight cache nothing is kept: hashed at every start.
    assert wid.weights_id(files, None) == third and len(hashed) == 3 * len(files)
