"""The prepared matrices kept in the weight cache (engine/model/prepared_cache.py): a restart
reads the CPU kernels' packed forms instead of packing the checkpoint again, and must serve
exactly what a start that packs them serves; an entry that does not fit is rebuilt, never
served; another dtype, quantization or preparing code is another entry."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from preheat.engine import LLM, SamplingParams
from preheat.engine.kernels import cpu_ext, linear
from preheat.engine.model import prepared_cache

pytestmark = pytest.mark.skipif(cpu_ext.load() is None, reason="the prepared forms are the CPU kernels'")

PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 160))]
PARAMS = SamplingParams(max_tokens=10, temperature=0)


def entries(cache) -> list:
    root = cache / "prepared"
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


def serve(model_dir, cache, **kw):
    llm = LLM(model=str(model_dir), weight_cache_dir=str(cache), max_total_tokens=1024, page_size=4, **kw)
    return llm, [r.token_ids for r in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("kw", [dict(dtype="bfloat16"), dict(dtype="float32"), dict(dtype="float32", quantization="int8"),
                                dict(dtype="float32", quantization="int8", int8_activation_bits=8)],
                         ids=["bf16", "f32", "int8", "int8-a8"])
def test_a_restart_reads_the_packed_matrices_and_serves_the_same_tokens(tiny_qwen2_dir, tmp_path, kw, caplog):
    first, tokens = serve(tiny_qwen2_dir, tmp_path, **kw)  # qwen2: q/k/v biases, a tied LM head
    (entry,) = entries(tmp_path)
    kept = first.engine.model
    del first
    with caplog.at_level("INFO", logger="preheat.engine.model.prepared_cache"):
        second, again = serve(tiny_qwen2_dir, tmp_path, **kw)
    assert f"read 9 matrices from {entry}" in caplog.text
    assert again == tokens
    for name, w in prepared_cache.model_linears(second.engine.model).items():
        before = prepared_cache.model_linears(kept)[name]
        assert (w.kind, w.shape, w.dense_from_rows, w.activation_bits) == (
            before.kind, before.shape, before.dense_from_rows, before.activation_bits)
        if w.kind == "int8" and 8 in w.kernels.int8_activation_bits_choices:
            assert w.activation_bits == kw.get("int8_activation_bits", 16)
        for part, t in linear.stored(w).items():
            assert torch.equal(t, linear.stored(before)[part]), (name, part)
    assert second.engine.model.step_weight_bytes == kept.step_weight_bytes


def test_another_dtype_or_quantization_is_another_entry_and_off_keeps_none(tiny_llama_dir, tmp_path):
    serve(tiny_llama_dir, tmp_path, dtype="bfloat16")
    serve(tiny_llama_dir, tmp_path, dtype="bfloat16", quantization="int8")
    serve(tiny_llama_dir, tmp_path, dtype="float32", quantization="int8")
    assert len(entries(tmp_path)) == 3
    serve(tiny_llama_dir, tmp_path, dtype="float32")  # float32 matrices are packed for their kernel too
    assert len(entries(tmp_path)) == 4
    serve(tiny_llama_dir, tmp_path, dtype="float32")  # and read back: no fifth entry
    assert len(entries(tmp_path)) == 4
    llm = LLM(model=str(tiny_llama_dir), weight_cache_dir="off", max_total_tokens=256, page_size=4)
    assert llm.engine.model.layers[0].attn.qkv.kind == "bf16"


def test_the_key_follows_the_preparing_code(monkeypatch, tmp_path):
    key = prepared_cache.entry_key("sha256:ab", torch.bfloat16, None, prepared_cache.preparing_code_hash())
    assert key != prepared_cache.entry_key("sha256:ab", torch.float32, None, prepared_cache.preparing_code_hash())
    assert key != prepared_cache.entry_key("sha256:ab", torch.bfloat16, "int8", prepared_cache.preparing_code_hash())
    assert key != prepared_cache.entry_key("sha256:cd", torch.bfloat16, None, prepared_cache.preparing_code_hash())
    changed = tmp_path / "linear.py"
    changed.write_bytes(prepared_cache.PREPARING_SOURCES[1].read_bytes() + b"\n# a new packing\n")
    sources = list(prepared_cache.PREPARING_SOURCES)
    monkeypatch.setattr(prepared_cache, "PREPARING_SOURCES", [sources[0], changed, *sources[2:]])
    assert prepared_cache.entry_key("sha256:ab", torch.bfloat16, None, prepared_cache.preparing_code_hash()) != key


def tamper(entry, edit) -> None:
    path = entry / prepared_cache.WEIGHTS_FILE
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    edit(meta, tensors)
    save_file(tensors, str(path), metadata=meta)


def cut_a_row_block(meta, tensors):
    tensors["layers.0.attn.o.packed"] = tensors["layers.0.attn.o.packed"][1:].contiguous()


def drop_a_matrix(meta, tensors):
    kinds = json.loads(meta["kinds"])
    del kinds["layers.1.mlp.down"]
    meta["kinds"] = json.dumps(kinds)
    del tensors["layers.1.mlp.down.packed"]


def claim_another_kind(meta, tensors):
    meta["kinds"] = meta["kinds"].replace('"bf16"', '"int8"', 1)


@pytest.mark.parametrize("edit", [cut_a_row_block, drop_a_matrix, claim_another_kind])
def test_an_entry_that_does_not_fit_is_rebuilt_not_served(tiny_llama_dir, tmp_path, edit, caplog):
    _, tokens = serve(tiny_llama_dir, tmp_path)
    (entry,) = entries(tmp_path)
    tamper(entry, edit)
    with caplog.at_level("WARNING", logger="preheat.engine.model.prepared_cache"):
        _, again = serve(tiny_llama_dir, tmp_path)
    assert "unusable" in caplog.text and again == tokens
    with caplog.at_level("INFO", logger="preheat.engine.model.prepared_cache"):
        caplog.clear()
        _, third = serve(tiny_llama_dir, tmp_path)  # the rebuilt entry replaced it
    assert "read 9 matrices" in caplog.text and third == tokens


def test_a_truncated_entry_is_rebuilt(tiny_llama_dir, tmp_path, caplog):
    _, tokens = serve(tiny_llama_dir, tmp_path)
    (entry,) = entries(tmp_path)
    path = entry / prepared_cache.WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:-100])
    with caplog.at_level("WARNING", logger="preheat.engine.model.prepared_cache"):
        _, again = serve(tiny_llama_dir, tmp_path)
    assert "unusable" in caplog.text and again == tokens


def test_restore_refuses_tensors_prepare_never_makes():
    w = torch.randn(40, 64, dtype=torch.bfloat16)
    kernels = cpu_ext.load()
    prepared = linear.prepare(w, None, torch.bfloat16, kernels)
    tensors = linear.stored(prepared)
    assert torch.equal(linear.restore("bf16", 40, 64, tensors, torch.bfloat16, kernels).packed, prepared.packed)
    with pytest.raises(ValueError):
        linear.restore("bf16", 64, 64, tensors, torch.bfloat16, kernels)  # another row count
    with pytest.raises(ValueError):
        linear.restore("bf16", 40, 64, {"packed": tensors["packed"].float()}, torch.bfloat16, kernels)
    with pytest.raises(ValueError):
        linear.restore("int8", 40, 64, tensors, torch.bfloat16, kernels)  # no scales
    with pytest.raises(ValueError):
        linear.restore("f32", 40, 64, tensors, torch.float32, kernels)  # bf16 pairs are not float32 columns
    f32 = linear.stored(linear.prepare(w.float(), None, torch.float32, kernels))
    assert torch.equal(linear.restore("f32", 40, 64, f32, torch.float32, kernels).packed, f32["packed"])
    with pytest.raises(ValueError):
        linear.restore("f32", 40, 32, f32, torch.float32, kernels)  # another input count
    with pytest.raises(ValueError):
        linear.stored(linear.prepare(w.float(), None, torch.float32))  # dense (no kernels): nothing packed
