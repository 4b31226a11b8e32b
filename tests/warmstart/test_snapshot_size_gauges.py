"""The engine publishes what the operator needs to size spec.snapshot.size (issue 31): KV
bytes per token (as its own check_size counts them), --snapshot-max-tokens, and the bytes of
the converted weights it loaded from its weight cache (they share a shared snapshot claim)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from preheat.engine.config import EngineConfig
from preheat.engine.kv.snapshot import DEFAULT_KEEP, model_fingerprint
from preheat.engine.metrics import Metrics
from preheat.engine.warm.warm_start import WarmStart, build_warm_start


def _fingerprint(dtype: str) -> dict:
    return model_fingerprint(architecture="LlamaForCausalLM", num_layers=30, num_kv_heads=3,
                             head_dim=64, dtype=dtype, page_size=16, tokenizer_hash="t")


def _engine(tmp_path, fingerprint: dict, hf_dir: str | None) -> SimpleNamespace:
    engine = SimpleNamespace(fingerprint=fingerprint, hf_dir=hf_dir,
                             pool=SimpleNamespace(capacity_pages=8, page_size=16))
    return SimpleNamespace(engine=engine, metrics=Metrics())


def test_bytes_per_token_and_the_weight_cache_entry_are_published(tmp_path):
    entry = tmp_path / "weights" / "abc-bfloat16-v1"
    entry.mkdir(parents=True)
    (entry / "model.safetensors").write_bytes(b"\0" * 5000)
    (entry / "config.json").write_text("{}")
    (entry / "DONE").write_text(json.dumps({"source": "x.gguf"}))
    aengine = _engine(tmp_path, _fingerprint("bfloat16"), str(entry))
    WarmStart.record_engine(aengine)
    r = aengine.metrics.registry
    # layers x (K and V) x KV heads x head_dim x 2 bytes of bfloat16
    assert r.get_sample_value("preheat_kv_cache_bytes_per_token") == 30 * 2 * 3 * 64 * 2
    assert r.get_sample_value("preheat_model_weight_cache_bytes") == \
        sum(f.stat().st_size for f in entry.iterdir())


def test_fp8_halves_it_and_a_model_read_in_place_has_no_cache_entry(tmp_path):
    in_place = tmp_path / "hf-model"  # a Hugging Face directory: no DONE, read where it is
    in_place.mkdir()
    (in_place / "model.safetensors").write_bytes(b"\0" * 5000)
    aengine = _engine(tmp_path, _fingerprint("float8_e4m3fn"), str(in_place))
    WarmStart.record_engine(aengine)
    r = aengine.metrics.registry
    assert r.get_sample_value("preheat_kv_cache_bytes_per_token") == 30 * 2 * 3 * 64
    assert r.get_sample_value("preheat_model_weight_cache_bytes") == 0


def test_snapshot_max_tokens_is_published_only_with_a_snapshot_dir(tmp_path):
    metrics = Metrics()
    build_warm_start(EngineConfig(snapshot_dir=str(tmp_path), snapshot_max_tokens=4096), metrics)
    assert metrics.registry.get_sample_value("preheat_snapshot_max_tokens") == 4096
    metrics = Metrics()
    build_warm_start(EngineConfig(snapshot_max_tokens=4096), metrics)
    assert metrics.registry.get_sample_value("preheat_snapshot_max_tokens") == 0

def test_the_operator_keeps_as_many_snapshots_as_the_engine_prunes_to():
    from preheat.operator.snapshot_storage import KEEP

    assert KEEP == DEFAULT_KEEP


def test_the_packed_matrices_kept_in_the_weight_cache_count_too(tmp_path):
    """engine/model/prepared_cache.py keeps the CPU kernels' packed matrices in the same
    cache: on a shared snapshot claim they take room as the converted weights do."""
    entries = []
    for name, size in (("weights/abc-bfloat16-v1", 5000), ("weights/prepared/0123", 3000)):
        entry = tmp_path / name
        entry.mkdir(parents=True)
        (entry / "model.safetensors").write_bytes(b"\0" * size)
        (entry / "DONE").write_text("{}")
        entries.append(entry)
    aengine = _engine(tmp_path, _fingerprint("bfloat16"), str(entries[0]))
    aengine.engine.prepared_dir = str(entries[1])
    WarmStart.record_engine(aengine)
    assert aengine.metrics.registry.get_sample_value("preheat_model_weight_cache_bytes") == \
        sum(f.stat().st_size for e in entries for f in e.iterdir())
