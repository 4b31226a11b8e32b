"""`--quantization int8`: the format, GGUF blocks read as they are, and the engine serving with
it (kernel and PyTorch reference agreeing; snapshots told apart)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from preheat.engine import LLM, SamplingParams
from preheat.engine.config import ConfigError, parse_args
from preheat.engine.kernels import cpu_ext, int8
from preheat.engine.model import gguf_weights, prepared_cache


def test_symmetric_quantization_is_within_half_a_step_per_weight():
    w = torch.randn(48, 160) * torch.logspace(-3, 1, 160)  # very different block ranges
    qw = int8.quantize(w)
    assert qw.codes.dtype == torch.uint8 and qw.scales.shape == (48, 5)
    err = (int8.dequantize(qw) - w).abs().reshape(48, 5, 32)
    step = qw.scales.float()[..., None]
    assert bool((err <= step / 2 + 1e-6 * w.abs().max()).all())
    assert int8.quantize(torch.zeros(16, 32)).scales.abs().sum() == 0  # an all-zero block stays zero


def test_a_matrix_whose_input_size_is_not_a_multiple_of_32_is_refused():
    with pytest.raises(ValueError, match="divisible by 32"):
        int8.quantize(torch.zeros(4, 48))


@pytest.mark.parametrize("kind,parse", [("Q4_0", gguf_weights.q4_0_blocks), ("Q4_1", gguf_weights.q4_1_blocks),
                                        ("Q8_0", gguf_weights.q8_0_blocks)])
def test_gguf_blocks_are_read_exactly(kind, parse):
    import gguf

    x = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind])
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    assert torch.equal(int8.dequantize(parse(raw)), torch.from_numpy(expected))


def q4_k_file_blocks(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Q4_K rows as a file holds them: random 6-bit scales/mins and nibbles (any bytes are a
    valid block) under float16 d / dmin of a real model's size (gguf has no Q4_K quantizer)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-4, 3e-3, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = rng.uniform(1e-4, 3e-3, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // 256 * 144)


def test_q4_k_super_blocks_become_4_bit_blocks_of_32_within_float16_rounding_of_a_scale():
    """Each sub-block of 32 gets d * sc and -dmin * mn as its float16 scale and offset: the
    only change is that rounding (2^-11 of a scale, against a 4-bit step of 1/15 of the
    range); the codes are the file's nibbles, so they stay 4-bit in the kernel."""
    import gguf

    raw = q4_k_file_blocks(16, 512)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K))
    qw = gguf_weights.q4_k_blocks(raw)
    assert qw.shape == (16, 512) and int(qw.codes.max()) <= 15
    ours = int8.dequantize(qw)
    step = (qw.scales.float().abs().repeat_interleave(32, dim=1))  # one code step, per weight
    offset = qw.offsets.float().abs().repeat_interleave(32, dim=1)
    assert torch.all((ours - expected).abs() <= (15 * step + offset) * 2**-10)
    assert (ours - expected).abs().max() > 0  # it is the float16 rounding, not a copy
    codes, _ = int8.pack(qw)
    assert codes.shape == (1, 512 // 4, 32)  # 4 bits a weight in the kernel's layout


def test_4_bit_gguf_formats_stay_4_bit_in_the_kernel():
    import gguf

    x = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    for kind, parse in (("Q4_0", gguf_weights.q4_0_blocks), ("Q4_1", gguf_weights.q4_1_blocks)):
        codes, _ = int8.pack(parse(gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind])))
        assert codes.shape == (1, 64 // 4, 32), kind
    codes, _ = int8.pack(gguf_weights.q8_0_blocks(gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)))
    assert codes.shape == (1, 64 // 2, 16, 2)  # 8-bit stays 8-bit


def test_auto_serves_a_block_quantized_gguf_in_its_blocks_where_the_kernels_read_them(tmp_path, tiny_llama_dir):
    from preheat.engine.model.locations import default_model_path
    from preheat.engine.model.quantize import effective_quantization

    gguf_q41 = default_model_path()  # general.file_type 3: MOSTLY_Q4_1
    assert effective_quantization(None, gguf_q41, kernels_read_blocks=True) == "int8"
    assert effective_quantization("auto", gguf_q41, kernels_read_blocks=True) == "int8"
    assert effective_quantization("none", gguf_q41, kernels_read_blocks=True) is None
    assert effective_quantization(None, gguf_q41, kernels_read_blocks=False) is None  # GPU, torch kernels
    assert effective_quantization("int8", gguf_q41, kernels_read_blocks=False) == "int8"  # asked for: kept
    assert effective_quantization(None, str(tiny_llama_dir), kernels_read_blocks=True) is None
    assert effective_quantization("int8", str(tiny_llama_dir), kernels_read_blocks=True) == "int8"


def test_q_and_k_rows_are_unpermuted_as_transformers_does():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = torch.randn(24, 64)
    expected = LlamaTensorProcessor()._reverse_permute_weights(w.numpy(), 6, 2)
    qw = gguf_weights.unpermute_rows(int8.quantize(w), 2)
    assert torch.equal(int8.dequantize(qw), int8.dequantize(int8.quantize(torch.from_numpy(expected))))


def test_gguf_names_map_to_transformers_names():
    assert gguf_weights.hf_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert gguf_weights.hf_name("blk.0.ffn_gate.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert gguf_weights.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_weights.hf_name("blk.0.attn_norm.weight") is None


@pytest.mark.slow
def test_the_embedded_gguf_int8_weights_are_the_weights_everything_else_reads():
    """Q4_1 layers and the Q8_0 embedding, unpermuted, equal transformers' dequantized
    weights: exactly, once both are rounded to the bfloat16 the engine serves."""
    from preheat.engine.model.loader import default_model_path, load_model

    loaded = load_model(None, torch.bfloat16, None)
    weights = gguf_weights.read_int8_weights(default_model_path(), loaded.spec.num_heads, loaded.spec.num_kv_heads)
    assert len(weights) == 7 * loaded.spec.num_layers + 1  # every layer matrix and the tied embedding
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(int8.dequantize(weights[name], torch.bfloat16), loaded.weights[name]), name


def test_the_flag_is_parsed_and_checked():
    assert parse_args(["--quantization", "int8"]).quantization == "int8"
    assert parse_args([]).quantization is None
    assert parse_args(["--quantization", "none"]).quantization == "none"
    with pytest.raises(ConfigError, match="--quantization: 'int4' is not one of auto, none, int8"):
        parse_args(["--quantization", "int4"])


def test_int8_serving_matches_its_reference_and_changes_the_snapshot_fingerprint(tiny_llama_dir, monkeypatch):
    """The int8 kernel path (linear layers on vpdpbusd) and the PyTorch reference of the same
    arithmetic generate the same greedy tokens; the KV of int8 weights is not interchangeable
    with the unquantized model's, so snapshots record the difference."""
    prompts = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 160))]
    params = SamplingParams(max_tokens=12, temperature=0)
    kw = dict(model=str(tiny_llama_dir), dtype="float32", max_total_tokens=2048, page_size=4)
    llm = LLM(quantization="int8", **kw)
    assert llm.engine.model.layers[0].attn.qkv.kind == ("int8" if cpu_ext.load() is not None else "int8-reference")
    ours = [r.token_ids for r in llm.generate(prompts, params)]
    fingerprint = llm.engine.fingerprint
    monkeypatch.setenv("PREHEAT_ATTENTION_BACKEND", "torch")
    reference = LLM(quantization="int8", **kw)
    assert reference.engine.model.layers[0].attn.qkv.kind == "int8-reference"
    assert [r.token_ids for r in reference.generate(prompts, params)] == ours
    plain = LLM(**kw)
    assert fingerprint["quantization"] == "int8" and "quantization" not in plain.engine.fingerprint


def test_the_activation_width_flag_is_parsed_and_checked():
    assert parse_args([]).int8_activation_bits == 16
    assert parse_args(["--int8-activation-bits", "8"]).int8_activation_bits == 8
    with pytest.raises(ConfigError, match="--int8-activation-bits: 4 is not one of 16, 8"):
        parse_args(["--int8-activation-bits", "4"])


@pytest.mark.skipif(cpu_ext.load() is None or 8 not in cpu_ext.load().int8_activation_bits_choices,
                    reason="8-bit activation codes are the AVX-512 VNNI build's")
def test_8_bit_activations_reach_every_int8_matrix_and_the_snapshot_fingerprint(tiny_llama_dir, monkeypatch):
    """--int8-activation-bits 8 multiplies by int8 activation codes (vpdpbusd): every int8
    matrix is told, the greedy tokens are those of the same arithmetic in PyTorch, and the
    snapshot fingerprint says so (its KV is not the 16-bit path's)."""
    prompts = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 160))]
    params = SamplingParams(max_tokens=12, temperature=0)
    kw = dict(model=str(tiny_llama_dir), dtype="float32", max_total_tokens=2048, page_size=4, quantization="int8")
    eight = LLM(int8_activation_bits=8, **kw)
    weights = prepared_cache.model_linears(eight.engine.model).values()
    assert {w.activation_bits for w in weights if w.kind == "int8"} == {8}
    assert eight.engine.fingerprint["int8_activation_bits"] == 8
    ours = [r.token_ids for r in eight.generate(prompts, params)]
    sixteen = LLM(**kw)
    assert {w.activation_bits for w in prepared_cache.model_linears(sixteen.engine.model).values()} == {16}
    assert "int8_activation_bits" not in sixteen.engine.fingerprint
    # The same model with every int8 matrix on reference_linear at 8 bits.
    for w in weights:
        if w.kind == "int8":
            w.weight = w.kernels.dense_int8(w.packed, w.scales, w.out_features, torch.float32)
            w.kind = "int8-reference"
    original = int8.reference_linear
    monkeypatch.setattr(int8, "reference_linear", lambda x, w, b=None, r=None: original(x, w, b, r, activation_bits=8))
    assert [r.token_ids for r in eight.generate(prompts, params)] == ours


@pytest.mark.slow
def test_the_embedded_gguf_is_served_in_its_own_blocks_by_default_and_dequantized_with_none():
    """llama.cpp serves a GGUF in its own quantization; so does the engine where its kernels
    read the blocks in place: the Q4_1 layers at 4 bits a weight. `none` dequantizes."""
    params = SamplingParams(max_tokens=8, temperature=0)
    default = LLM(max_total_tokens=512, page_size=16)
    qkv = default.engine.model.layers[0].attn.qkv
    if cpu_ext.load() is None:  # no kernels here: auto dequantizes (the reference would be slower)
        assert default.engine.quantization is None
    else:
        assert default.engine.quantization == "int8" and default.engine.fingerprint["quantization"] == "int8"
        assert qkv.kind == "int8" and qkv.packed.shape[1] == qkv.in_features // 4  # 4-bit codes
    out = default.generate(["The three primary colours are"], params)[0]
    assert len(out.token_ids) == 8
    del default
    none = LLM(max_total_tokens=512, page_size=16, quantization="none")
    assert none.engine.quantization is None and "quantization" not in none.engine.fingerprint
    assert none.engine.model.layers[0].attn.qkv.kind != "int8"



def test_the_fast_tensor_table_is_what_gguf_reader_reads(tmp_path):
    """read_int8_weights reads the tensor table with gguf_meta (GGUFReader decodes the whole
    vocabulary first: seconds at every start); both must see the same bytes, whatever the
    alignment and tensor types."""
    import gguf

    from preheat.engine.model.gguf_meta import read_gguf_tensors

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_token_list([f"tok{i}" for i in range(300)])  # an array of strings to skip
    rng = np.random.default_rng(3)
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((8, 64)).astype(np.float32))
    w.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(rng.standard_normal((16, 96)).astype(np.float32),
                 gguf.GGMLQuantizationType.Q4_0), raw_dtype=gguf.GGMLQuantizationType.Q4_0)  # fmt: skip
    w.add_tensor("blk.0.ffn_down.weight", rng.standard_normal((4, 32)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(path))
    records = read_gguf_tensors(path)
    assert [r.name for r in records] == [t.name for t in reader.tensors]
    raw = path.read_bytes()
    for record, tensor in zip(records, reader.tensors):
        assert record.tensor_type == tensor.tensor_type
        assert record.start == tensor.data_offset and record.nbytes == tensor.n_bytes
        assert raw[record.start : record.start + record.nbytes] == np.asarray(tensor.data).tobytes()
    assert records[1].shape == (16, 96)
    weights = gguf_weights.read_int8_weights(path, num_heads=2, num_kv_heads=2)
    q4 = gguf.GGMLQuantizationType.Q4_0
    expected = gguf.quants.dequantize(np.asarray(reader.tensors[1].data), q4)
    assert torch.equal(int8.dequantize(weights["model.layers.0.mlp.up_proj.weight"]), torch.from_numpy(expected))
