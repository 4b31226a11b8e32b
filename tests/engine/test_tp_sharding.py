"""Tensor-parallel sharding and the step messages, without processes: which heads and widths a
rank holds, that the shards of every family sum to the whole model (ranks run as threads here,
an all-reduce between them standing in for the collective), that the message layout round
trips, and that the whole KV is rebuilt from and cut into the ranks' heads."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers
from tiny_models import build_tiny_model

from preheat.engine.distributed.kv import join_heads, split_heads
from preheat.engine.distributed.messages import (
    HEADER,
    MIN_CAPACITY,
    Op,
    ProtocolError,
    decode_values,
    encode_values,
    frame,
    grown_capacity,
    pack_step,
    unframe,
    unpack_step,
)
from preheat.engine.distributed.sharding import (
    Sharder,
    TensorParallelError,
    check_tp_size,
    head_split,
    kv_head_sources,
    local_kv_heads,
)
from preheat.engine.kv.pool import KVPool
from preheat.engine.model.build import build_model
from preheat.engine.model.decoder import AttentionMetadata
from preheat.engine.model.loader import load_model
from preheat.engine.model.quantize import quantize_weights
from preheat.engine.model.sharding import WholeWeights
from preheat.engine.model.spec import ModelSpec

# --------------------------------------------------------------------------- heads


@pytest.mark.parametrize(
    "heads,kv_heads,size",
    [(4, 2, 2), (4, 1, 2), (8, 2, 4), (8, 8, 4), (32, 8, 16), (16, 4, 8), (4, 4, 1)],
)
def test_every_query_head_finds_its_kv_head_on_its_own_rank(heads, kv_heads, size):
    group = heads // kv_heads
    seen_q = []
    for rank in range(size):
        s = head_split(heads, kv_heads, size, rank)
        assert s.kv_count == local_kv_heads(kv_heads, size)
        for q in range(s.q_start, s.q_start + s.q_count):
            assert s.kv_start <= q // group < s.kv_start + s.kv_count  # GQA: head q reads kv head q // group
            seen_q.append(q)
    assert seen_q == list(range(heads))  # each query head on exactly one rank


def test_fewer_kv_heads_than_ranks_replicates_each_on_the_ranks_that_read_it():
    # 2 KV heads over 4 ranks: ranks 0, 1 keep head 0; ranks 2, 3 keep head 1.
    assert [head_split(8, 2, 4, r).kv_start for r in range(4)] == [0, 0, 1, 1]
    assert kv_head_sources(2, 4) == [(0, 0), (2, 0)]
    assert kv_head_sources(4, 2) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def spec_of(**overrides) -> ModelSpec:
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=100)
    return ModelSpec.from_hf_config(transformers.LlamaConfig(**{**base, **overrides}))


@pytest.mark.parametrize(
    "overrides,size,problem",
    [
        ({}, 3, "4 attention heads"),
        ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}, 2, "3 KV heads"),
        ({"intermediate_size": 130}, 4, "MLP width 130"),
    ],
)
def test_a_size_that_does_not_divide_the_model_is_refused_naming_what(overrides, size, problem):
    with pytest.raises(TensorParallelError, match=f"--tensor-parallel-size {size} does not divide .*{problem}"):
        check_tp_size(spec_of(**overrides), size)


def test_int8_row_parallel_slices_must_be_whole_blocks():
    # 64-wide o_proj input and 128-wide MLP: 2 ranks get 32 and 64 columns (whole blocks), 4
    # ranks 16 of o_proj's: an int8 block's scale would straddle two ranks.
    check_tp_size(spec_of(), 2, "int8")
    check_tp_size(spec_of(), 4)
    with pytest.raises(TensorParallelError, match="o_proj input 64 with --quantization int8"):
        check_tp_size(spec_of(), 4, "int8")
    # A width no multiple of 32 is not quantized at all, so it splits as a tensor does.
    check_tp_size(spec_of(intermediate_size=136), 2, "int8")


def test_an_int8_weight_is_cut_like_its_tensor():
    from preheat.engine.kernels import int8

    w = torch.randn(48, 128)
    qw = int8.quantize(w)
    sharder = Sharder(spec_of(hidden_size=128, intermediate_size=128), 2, 1)
    assert torch.equal(int8.dequantize(sharder.down(qw)), int8.dequantize(qw)[:, 64:])
    rows = sharder.gate_up(qw, qw)
    assert torch.equal(int8.dequantize(rows), torch.cat([int8.dequantize(qw)[24:]] * 2))
    with pytest.raises(ValueError, match="multiples of 32"):
        qw.narrow(1, 16, 32)


def test_one_rank_cuts_nothing_as_the_model_side_whole_weights_do():
    """build_model's default (engine/model/sharding.py) and a one-rank Sharder agree, dense
    and int8 alike, so a one-rank build is the same wherever its sharder comes from."""
    from preheat.engine.kernels import int8

    spec = spec_of()
    one, whole = Sharder(spec, 1, 0), WholeWeights(spec)
    assert one.heads == whole.heads
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g)
    for a in (w, int8.quantize(w)):
        dense = int8.dequantize if isinstance(a, int8.QuantizedWeight) else (lambda t: t)
        assert torch.equal(dense(one.qkv(a, a, a)), dense(whole.qkv(a, a, a)))
        assert torch.equal(dense(one.gate_up(a, a)), dense(whole.gate_up(a, a)))
        assert one.o(a) is whole.o(a) is a and one.down(a) is whole.down(a) is a
    b = w[0]
    assert one.reduced_bias(b) is whole.reduced_bias(b) is b


def test_the_expert_width_must_divide_too():
    config = transformers.Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                         num_experts=4, moe_intermediate_size=30, intermediate_size=128)
    with pytest.raises(TensorParallelError, match="expert width 30"):
        check_tp_size(ModelSpec.from_hf_config(config), 4)
    check_tp_size(ModelSpec.from_hf_config(config), 2)


# --------------------------------------------------------------------------- shards sum to the model


class ThreadAllReduce:
    """An all-reduce between threads (one per rank), summing in rank order."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.parts: list[torch.Tensor | None] = [None] * size

    def reducer(self, rank: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = self.parts[0].clone()
            for p in self.parts[1:]:
                total += p
            self.barrier.wait()
            t.copy_(total)
            return t

        return reduce


def steps(vocab: int) -> list[tuple[torch.Tensor, AttentionMetadata]]:
    """A prefill of two sequences (5 and 3 tokens, page size 4), then a mixed step: a decode
    of the first and the rest of the second's prompt."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (12,), generator=g)
    table = torch.tensor([[1, 2, 0], [3, 4, 0]], dtype=torch.int32)
    prefill = AttentionMetadata(
        positions=torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]), slots=torch.tensor([4, 5, 6, 7, 8, 12, 13, 14]),
        num_decode=0, decode_page_table=None, decode_seq_lens=None, extend_page_table=table,
        extend_prefix_lens=[0, 0], extend_lens=[5, 3],
    )  # fmt: skip
    mixed = AttentionMetadata(
        positions=torch.tensor([5, 3, 4, 5]), slots=torch.tensor([9, 15, 16, 17]), num_decode=1,
        decode_page_table=table[:1], decode_seq_lens=torch.tensor([6], dtype=torch.int32),
        extend_page_table=table[1:], extend_prefix_lens=[3], extend_lens=[3],
    )  # fmt: skip
    return [(ids[:8], prefill), (ids[8:], mixed)]


def run_model(model, spec, heads: int, inputs) -> list[torch.Tensor]:
    pool = KVPool(spec.num_layers, heads, spec.head_dim, 8, 4, torch.float32, torch.device("cpu"))
    return [model.logits(model.forward(ids, meta, pool)) for ids, meta in inputs]


@pytest.mark.parametrize("family", ["llama-biases", "llama-one-kv-head", "qwen2", "qwen3", "qwen3_moe", "mixtral",
                                    "llama-int8"])  # fmt: skip
def test_two_ranks_compute_what_one_does(family, tmp_path, smollm_tokenizer):
    arch, overrides = {
        "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
        "llama-int8": ("llama", {"attention_bias": True, "mlp_bias": True}),
        "llama-one-kv-head": ("llama", {"num_key_value_heads": 1}),
        "qwen2": ("qwen2", {}),
        "qwen3": ("qwen3", {}),
        "qwen3_moe": ("qwen3_moe", {}),
        "mixtral": ("mixtral", {}),
    }[family]
    path = build_tiny_model(tmp_path / family, arch, smollm_tokenizer, **overrides)
    loaded = load_model(str(path), torch.float32, "off")
    spec, cpu = loaded.spec, torch.device("cpu")
    weights = loaded.weights
    if family.endswith("int8"):  # every rank quantizes whole matrices, then cuts its slice
        weights = quantize_weights(weights, spec, loaded.source, "int8")
    inputs = steps(spec.vocab_size)
    whole = run_model(build_model(spec, loaded.hf_config, weights, cpu, torch.float32), spec,
                      spec.num_kv_heads, inputs)  # fmt: skip
    reducer, results = ThreadAllReduce(2), {}

    def rank(r: int) -> None:
        shard = build_model(spec, loaded.hf_config, weights, cpu, torch.float32,
                            sharder=Sharder(spec, 2, r), reduce=reducer.reducer(r))  # fmt: skip
        assert shard.layers[0].attn.num_heads == spec.num_heads // 2
        assert shard.layers[0].attn.o.kind.startswith("int8") == family.endswith("int8")
        results[r] = run_model(shard, spec, local_kv_heads(spec.num_kv_heads, 2), inputs)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    with torch.inference_mode():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    # int8: the multiply rounds its input to int16 per block of 32 (engine/kernels/int8.py), so
    # a last-bit difference in the reduced activations can move an input by one int16 step.
    tol = 2e-3 if family.endswith("int8") else 1e-4
    for r in range(2):
        for got, want in zip(results[r], whole):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_row_parallel_bias_is_added_by_rank_zero_only():
    spec = spec_of()
    b = torch.ones(64)
    assert Sharder(spec, 2, 0).reduced_bias(b) is b and Sharder(spec, 2, 1).reduced_bias(b) is None


def test_experts_are_split_inside_each_expert_gate_and_up_alike():
    spec = ModelSpec.from_hf_config(transformers.MixtralConfig(hidden_size=8, intermediate_size=4,
                                                               num_attention_heads=2, num_key_value_heads=2))
    w13 = torch.arange(2 * 8 * 8, dtype=torch.float32).reshape(2, 8, 8)  # E=2, 2I=8, H=8
    w2 = torch.arange(2 * 8 * 4, dtype=torch.float32).reshape(2, 8, 4)
    a, b = Sharder(spec, 2, 1).experts(w13, w2)
    assert torch.equal(a, torch.cat([w13[:, 2:4], w13[:, 6:8]], dim=1))  # gate rows 2:4, up rows 2:4
    assert torch.equal(b, w2[:, :, 2:4])


# --------------------------------------------------------------------------- KV heads


@pytest.mark.parametrize("kv_heads,size", [(4, 2), (2, 2), (1, 2), (2, 4), (8, 4)])
def test_whole_kv_is_cut_into_rank_heads_and_joined_back(kv_heads, size):
    full = torch.randn(2, 2, 8, kv_heads, 3)
    parts = split_heads(full, size)
    assert all(p.shape[-2] == local_kv_heads(kv_heads, size) for p in parts)
    assert torch.equal(join_heads(parts, kv_heads), full)


# --------------------------------------------------------------------------- messages


def test_a_frame_round_trips_and_a_foreign_one_is_refused():
    payload = torch.arange(5, dtype=torch.int64)
    buf = frame(Op.STEP, payload, MIN_CAPACITY, MIN_CAPACITY)
    op, got, nxt = unframe(buf)
    assert op is Op.STEP and torch.equal(got, payload) and nxt == MIN_CAPACITY
    bad = buf.clone()
    bad[0] = 7
    with pytest.raises(ProtocolError, match="magic"):
        unframe(bad)
    bad = buf.clone()
    bad[1] = 99
    with pytest.raises(ProtocolError, match="unknown op"):
        unframe(bad)
    with pytest.raises(ValueError):
        frame(Op.STEP, torch.zeros(MIN_CAPACITY, dtype=torch.int64), MIN_CAPACITY, MIN_CAPACITY)


def test_capacity_grows_by_powers_of_two_and_only_when_needed():
    assert grown_capacity(MIN_CAPACITY, MIN_CAPACITY) is None
    assert grown_capacity(MIN_CAPACITY, MIN_CAPACITY + 1) == 2 * MIN_CAPACITY
    assert grown_capacity(MIN_CAPACITY, 5 * MIN_CAPACITY) == 8 * MIN_CAPACITY
    assert grown_capacity(8 * MIN_CAPACITY, HEADER + 3) is None  # never shrinks


def test_values_of_every_kind_round_trip():
    values = [None, 3, -2**40, True, 0.1, [], [5, -1, 7], torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
              torch.tensor([True, False]), torch.tensor([1.5, -0.25], dtype=torch.bfloat16),
              torch.randn(3, 2), torch.zeros(0, 4, dtype=torch.int64)]  # fmt: skip
    got = decode_values(encode_values(values))
    assert len(got) == len(values)
    for a, b in zip(got, values):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        else:
            assert a == b and type(a) is type(b)


def test_what_cannot_travel_is_refused_not_pickled():
    for bad in ([1.5], {"a": 1}, "text", [[1]]):
        with pytest.raises(TypeError):
            encode_values([bad])
    with pytest.raises(ProtocolError):
        decode_values(torch.tensor([2, 10, 1]))  # a list of 10 with one element given


def test_a_step_round_trips_with_every_metadata_field():
    (ids, meta), (ids2, meta2) = steps(100)
    for i, m in ((ids, meta), (ids2, meta2)):
        got_ids, got = unpack_step(pack_step(i, m), "cpu")
        assert torch.equal(got_ids, i)
        for name, want in vars(m).items():
            have = getattr(got, name)
            assert torch.equal(have, want) if isinstance(want, torch.Tensor) else have == want
