"""What the model layer decides per family, checked against transformers' own modules where
there is one: which layers have experts, how the router normalises, what the experts compute,
which checkpoints (and GGUF files) are accepted, and that a snapshot of one family never
restores into another."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
import torch.nn.functional as F
import transformers
from tiny_models import build_tiny_model

from preheat.engine import LLM
from preheat.engine.model import moe as moe_module
from preheat.engine.model.build import build_model, expert_tensors
from preheat.engine.model.families import FAMILIES, UnsupportedModelError, gguf_model_type
from preheat.engine.model.gguf_meta import gguf_identity, read_gguf_metadata
from preheat.engine.model.loader import load_model, weight_files
from preheat.engine.model.moe import grouped_experts_torch, select_experts
from preheat.engine.model.preflight import check_supported
from preheat.engine.model.spec import ModelSpec

SUPPORTED = "llama, mistral, mixtral, qwen2, qwen3, qwen3_moe"

# --------------------------------------------------------------------------- spec


def test_qwen3_moe_layers_follow_mlp_only_layers_and_the_sparse_step():
    config = transformers.Qwen3MoeConfig(num_hidden_layers=6, num_experts=8, num_experts_per_tok=2,
                                         decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False)
    spec = ModelSpec.from_hf_config(config)
    # transformers: layer i is sparse when i not in mlp_only_layers and (i + 1) % step == 0
    torch_model_sparse = tuple(i for i in range(6) if i != 3 and (i + 1) % 2 == 0)
    assert spec.moe.sparse_layers == torch_model_sparse == (1, 5)
    assert spec.moe.renormalize is False and spec.moe.top_k == 2 and spec.moe.num_experts == 8
    assert spec.qk_norm


def test_mixtral_has_experts_in_every_layer_and_always_renormalises():
    spec = ModelSpec.from_hf_config(transformers.MixtralConfig(num_hidden_layers=3, num_local_experts=8))
    assert spec.moe.sparse_layers == (0, 1, 2) and spec.moe.renormalize and spec.moe.top_k == 2
    assert not spec.qk_norm


def test_qwen3_head_dim_comes_from_the_config_not_hidden_over_heads():
    spec = ModelSpec.from_hf_config(transformers.Qwen3Config(hidden_size=1024, num_attention_heads=16, head_dim=128))
    assert spec.head_dim == 128 and spec.qk_norm and spec.moe is None


@pytest.mark.parametrize("model_type", ["gpt2", "gemma3", "qwen2_moe", None])
def test_an_unsupported_family_is_refused_naming_the_supported_ones(model_type):
    class Config:
        pass

    config = Config()
    config.model_type = model_type
    with pytest.raises(UnsupportedModelError, match=f"unsupported model type {model_type!r}; supported: {SUPPORTED}$"):
        ModelSpec.from_hf_config(config)


def test_the_family_table_is_what_the_message_lists():
    assert ", ".join(sorted(FAMILIES)) == SUPPORTED


def test_a_non_silu_mlp_is_refused():
    with pytest.raises(UnsupportedModelError, match="activation 'gelu'"):
        ModelSpec.from_hf_config(transformers.LlamaConfig(hidden_act="gelu"))


# --------------------------------------------------------------------------- routing and experts


def qwen3_moe_config(norm_topk_prob: bool, top_k: int = 3):
    return transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=6,
                                       num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen3_moe_routing_is_transformers_routing(norm_topk_prob):
    config = qwen3_moe_config(norm_topk_prob)
    router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(37, 32, generator=torch.Generator().manual_seed(0))
    _, want_weights, want_ids = router(x)
    weights, ids = select_experts(F.linear(x, router.weight.detach()), config.num_experts_per_tok, norm_topk_prob)
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_weights.detach())
    if not norm_topk_prob:
        assert not torch.allclose(weights.sum(-1), torch.ones(37))  # really not renormalised


def test_mixtral_routing_is_a_softmax_over_the_top_k_logits_as_transformers_computes_it():
    config = transformers.MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)
    router = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(29, 32, generator=torch.Generator().manual_seed(1))
    _, want_weights, want_ids = router(x)
    logits = F.linear(x, router.weight.detach())
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights.detach())
    torch.testing.assert_close(weights, torch.softmax(logits.gather(1, ids), dim=-1))


def test_grouped_experts_compute_what_transformers_experts_compute():
    config = qwen3_moe_config(True)
    experts = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(experts.down_proj, std=0.3)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(41, 32, generator=g)
    weights, ids = select_experts(torch.randn(41, 6, generator=g), 3, True)
    want = experts(x, ids, weights)
    got = grouped_experts_torch(x, experts.gate_up_proj.detach(), experts.down_proj.detach(), weights, ids)
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)


def test_experts_run_one_matmul_pair_per_active_expert_not_per_token(monkeypatch):
    calls = []
    real_linear = F.linear

    def counting_linear(x, w, b=None):
        calls.append(x.shape[0])
        return real_linear(x, w, b)

    monkeypatch.setattr(moe_module.F, "linear", counting_linear)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 16, generator=g)
    w13, w2 = torch.randn(4, 2 * 8, 16, generator=g), torch.randn(4, 16, 8, generator=g)
    weights, ids = select_experts(torch.randn(200, 4, generator=g), 2, True)
    grouped_experts_torch(x, w13, w2, weights, ids)
    assert len(calls) == 2 * len(ids.unique())  # gate/up and down, once per expert
    assert sum(calls) == 2 * 200 * 2  # every (token, expert) pair once in each


# --------------------------------------------------------------------------- checkpoints


def test_a_sharded_checkpoint_loads_exactly_the_shards_its_index_names(tiny_qwen3_moe_dir):
    index = json.loads((tiny_qwen3_moe_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert [f.name for f in weight_files(tiny_qwen3_moe_dir)] == shards


def test_stray_safetensors_beside_an_index_are_not_loaded(tmp_path, smollm_tokenizer):
    model_dir = build_tiny_model(tmp_path / "m", "llama", smollm_tokenizer, max_shard_size="5MB",
                                 num_hidden_layers=1)  # fmt: skip
    # Mistral repositories ship consolidated.safetensors (other names, same weights) too.
    (model_dir / "consolidated.safetensors").write_bytes(b"not even safetensors")
    assert "consolidated.safetensors" not in [f.name for f in weight_files(model_dir)]
    load_model(str(model_dir), torch.float32, "off")  # would fail reading the stray file


def test_a_shard_the_index_names_but_that_is_missing_is_reported(tmp_path, smollm_tokenizer):
    model_dir = build_tiny_model(tmp_path / "m", "llama", smollm_tokenizer, max_shard_size="5MB",
                                 num_hidden_layers=1)  # fmt: skip
    shard = sorted(model_dir.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"missing: {shard.name}"):
        weight_files(model_dir)


def test_stacked_and_per_expert_layouts_give_the_same_experts(tiny_qwen3_moe_dir, smollm_tokenizer):
    """Checkpoints on disk hold one tensor per expert; transformers 5 holds them stacked in
    memory (what a GGUF conversion's state_dict, and so the weight cache, contains)."""
    from safetensors.torch import load_file

    on_disk = {}
    for f in weight_files(tiny_qwen3_moe_dir):
        on_disk.update(load_file(str(f)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype=torch.float32)
    in_memory = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in in_memory
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in on_disk
    spec = ModelSpec.from_hf_config(hf.config)
    for layer in spec.moe.sparse_layers:
        p = f"model.layers.{layer}."
        a = expert_tensors(on_disk, p, spec.moe.num_experts, spec.moe.intermediate_size, spec.hidden_size)
        b = expert_tensors(in_memory, p, spec.moe.num_experts, spec.moe.intermediate_size, spec.hidden_size)
        assert a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    model = build_model(spec, hf.config, in_memory, torch.device("cpu"), torch.float32)
    assert len(model.layers) == 3


def test_mixtral_checkpoint_names_map_to_gate_up_and_down(tiny_mixtral_dir):
    from safetensors.torch import load_file

    hf = {}
    for f in weight_files(tiny_mixtral_dir):
        hf.update(load_file(str(f)))
    p = "model.layers.1."
    router, w13, w2 = expert_tensors(hf, p, 4, 128, 64)
    assert router == p + "block_sparse_moe.gate.weight"
    e = p + "block_sparse_moe.experts.2."
    assert torch.equal(w13[2], torch.cat([hf[e + "w1.weight"], hf[e + "w3.weight"]]))  # gate (w1) first
    assert torch.equal(w2[2], hf[e + "w2.weight"])


# --------------------------------------------------------------------------- GGUF


@pytest.mark.parametrize(
    "arch,name,experts,expected",
    [
        ("llama", "SmolLM2 135M", 0, "llama"),
        ("llama", "Mistral 7B Instruct", 0, "mistral"),
        ("qwen2", "Qwen2.5 0.5B", 0, "qwen2"),
        ("qwen3", "Qwen3 0.6B", 0, "qwen3"),
        ("qwen3moe", "Qwen3 30B A3B", 128, "qwen3_moe"),
    ],
)
def test_gguf_architectures_transformers_reads_are_accepted(arch, name, experts, expected):
    assert gguf_model_type(arch, name, experts) == expected


@pytest.mark.parametrize(
    "arch,experts,message",
    [
        ("llama", 8, "architecture 'llama' with 8 experts .*Mixtral-style.*safetensors checkpoint"),
        ("gpt2", 0, f"unsupported GGUF architecture 'gpt2'; supported model types: {SUPPORTED}"),
        ("qwen2moe", 60, "unsupported GGUF architecture 'qwen2moe'"),
    ],
)
def test_gguf_files_we_cannot_run_whole_are_refused(arch, experts, message):
    with pytest.raises(UnsupportedModelError, match=message):
        gguf_model_type(arch, "", experts)


def write_gguf(path, arch: str, name: str, expert_count: int | None = None) -> None:
    """A GGUF whose header has every kind of field (arrays of strings among them), before
    and after the ones we read. No tensors: nothing here is loaded."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(3000)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(3000)])
    w.add_uint32(f"{arch}.block_count", 2)
    w.add_bool("some.flag", True)
    w.add_float64("some.float", 1.5)
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    if expert_count is not None:
        w.add_uint32(f"{arch}.expert_count", expert_count)
    w.add_int64("some.last", -7)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_header_reader_agrees_with_the_gguf_package(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen3moe", "Tiny MoE", expert_count=16)
    keys = {"general.architecture", "general.name", "qwen3moe.expert_count", "qwen3moe.block_count",
            "some.flag", "some.float", "tokenizer.chat_template", "some.last", "absent.key"}  # fmt: skip
    got = read_gguf_metadata(path, keys)
    reader = gguf.GGUFReader(str(path))
    for key in keys - {"absent.key"}:
        field = reader.fields[key]
        want = field.contents()
        assert got[key] == (pytest.approx(want) if isinstance(want, float) else want), key
    assert "absent.key" not in got
    assert gguf_identity(path) == ("qwen3moe", "Tiny MoE", 16)


def test_a_mixtral_gguf_is_refused_before_any_conversion(tmp_path, monkeypatch):
    path = tmp_path / "mixtral-8x7b.gguf"
    write_gguf(path, "llama", "Mixtral 8x7B", expert_count=8)

    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted a GGUF that should have been refused")

    monkeypatch.setattr("preheat.engine.model.loader._load_gguf", must_not_convert)
    monkeypatch.setattr("preheat.engine.model.loader.weights_id", must_not_convert)  # no hashing either
    with pytest.raises(UnsupportedModelError, match="Mixtral-style"):
        load_model(str(path), torch.float32, str(tmp_path / "cache"))


def test_check_supported_reads_config_json_or_the_gguf_header(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert check_supported(str(tmp_path / "d")) == "qwen3_moe"
    (tmp_path / "d" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        check_supported(str(tmp_path / "d"))
    write_gguf(tmp_path / "q.gguf", "qwen3", "Qwen3 tiny")
    assert check_supported(str(tmp_path / "q.gguf")) == "qwen3"
    assert check_supported(None) is None  # the embedded model
    assert check_supported(str(tmp_path / "nothing-here")) is None  # the loader says what is missing
    (tmp_path / "x.gguf").write_bytes(b"not a gguf")
    assert check_supported(str(tmp_path / "x.gguf")) is None


# --------------------------------------------------------------------------- snapshots


def test_a_qwen3_snapshot_cannot_restore_into_a_qwen3_moe_model(tmp_path, smollm_tokenizer):
    """Same layer count, KV heads, head_dim, dtype, page size and tokenizer: only the family
    (and the weights) differ, and that is enough to refuse."""
    from preheat.engine.kv.snapshot import fingerprint_difference, load_latest_snapshot, save_snapshot

    dense = build_tiny_model(tmp_path / "dense", "qwen3", smollm_tokenizer)
    sparse = build_tiny_model(tmp_path / "sparse", "qwen3_moe", smollm_tokenizer, num_hidden_layers=2,
                              mlp_only_layers=[])  # fmt: skip
    kwargs = dict(dtype="float32", page_size=4, max_total_tokens=256)
    a, b = LLM(model=str(dense), **kwargs).engine, LLM(model=str(sparse), **kwargs).engine
    difference = fingerprint_difference(b.fingerprint, a.fingerprint)
    assert difference == "architecture: snapshot has 'qwen3', this engine 'qwen3_moe'"
    same_shapes = {k: v for k, v in a.fingerprint.items() if k not in ("architecture", "model_id")}
    assert same_shapes == {k: v for k, v in b.fingerprint.items() if k not in ("architecture", "model_id")}

    from preheat.engine import SamplingParams

    a.add_request(list(range(10, 30)), SamplingParams(max_tokens=1, temperature=0))
    while a.has_unfinished():
        a.step()
    records = a.export_prefixes(None)
    assert records
    save_snapshot(tmp_path / "snaps", a.fingerprint, records, "pod-a")
    assert load_latest_snapshot(tmp_path / "snaps", a.fingerprint).path is not None
    refused = load_latest_snapshot(tmp_path / "snaps", b.fingerprint)
    assert refused.path is None
    assert [r.reason for r in refused.rejected] == ["fingerprint_mismatch"]


# --------------------------------------------------------------------------- preheat serve


@pytest.mark.parametrize("kind", ["hf-dir", "gguf"])
def test_serve_refuses_an_unsupported_model_at_start_with_one_line_and_exit_2(tmp_path, kind):
    """Like a bad flag or a bad template: refused before the server listens or loads."""
    import subprocess
    import sys

    if kind == "hf-dir":
        model = tmp_path / "gpt2-dir"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
        reason = f"unsupported model type 'gpt2'; supported: {SUPPORTED}"
    else:
        model = tmp_path / "mixtral.gguf"
        write_gguf(model, "llama", "Mixtral 8x7B", expert_count=8)
        reason = "Mixtral-style"
    done = subprocess.run([sys.executable, "-m", "preheat", "serve", "--model", str(model), "--port", "1"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"preheat serve: error: --model {model}: "), done.stderr
    assert reason in lines[0]


def test_a_sliding_window_caps_the_context_for_mixtral_and_qwen3_as_for_mistral():
    """Our attention is full attention: within the window it is what a sliding window computes."""
    windowed = transformers.MixtralConfig(max_position_embeddings=32768, sliding_window=4096)
    assert ModelSpec.from_hf_config(windowed).max_position_embeddings == 4096
    assert ModelSpec.from_hf_config(transformers.MixtralConfig(sliding_window=None)).max_position_embeddings == 131072
    qwen3 = transformers.Qwen3Config(max_position_embeddings=40960, use_sliding_window=True, sliding_window=4096)
    assert ModelSpec.from_hf_config(qwen3).max_position_embeddings == 4096
    unused = transformers.Qwen3Config(max_position_embeddings=40960, use_sliding_window=False, sliding_window=4096)
    assert ModelSpec.from_hf_config(unused).max_position_embeddings == 40960
