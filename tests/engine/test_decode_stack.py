"""A decode step's layers in one C++ call (engine/model/decode_stack.py) give the very bits
the layers give one kernel call at a time, for every kind of packed weight; layers the stack
does not run (q/k norm) and steps it does not take (prompts) keep the old path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_models import build_tiny_model

from preheat.engine import LLM, SamplingParams
from preheat.engine.kernels import cpu_attention, cpu_ext
from preheat.engine.model import decode_stack

kernels = cpu_ext.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="the stack runs the CPU kernels")


@pytest.fixture(scope="module")
def llama_hd64(tmp_path_factory, smollm_tokenizer):
    return build_tiny_model(tmp_path_factory.mktemp("stack-llama"), "llama", smollm_tokenizer,
                            hidden_size=256, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, smollm_tokenizer):  # q/k/v biases
    return build_tiny_model(tmp_path_factory.mktemp("stack-qwen2"), "qwen2", smollm_tokenizer,
                            hidden_size=256, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, smollm_tokenizer):  # q/k norms: not stacked
    return build_tiny_model(tmp_path_factory.mktemp("stack-qwen3"), "qwen3", smollm_tokenizer)


PROMPTS = [list(range(300, 340)), list(range(1000, 1077)), list(range(2000, 2013))]
seen_logits: list[torch.Tensor] = []  # every step's logits in the last decode_hiddens run


def decode_hiddens(monkeypatch, model_dir, stacked: bool, **config) -> tuple[list[torch.Tensor], int, bool]:
    """The final hidden states of every decode-only step of three greedy requests, how many
    steps went through the stack, and whether the model built one."""
    monkeypatch.setenv(decode_stack.ENV_SWITCH, "1" if stacked else "0")
    llm = LLM(model=str(model_dir), max_total_tokens=4096, page_size=16, **config)
    model = llm.engine.model
    seen: list[torch.Tensor] = []
    seen_logits.clear()
    stack_calls = [0]
    forward = model.forward

    def recording(input_ids, meta, kv_pool):
        out = forward(input_ids, meta, kv_pool)
        if meta.num_decode == input_ids.shape[0]:
            seen.append(out.clone())
        return out

    model.forward = recording
    logits = model.logits

    def recording_logits(hidden):
        out = logits(hidden)
        seen_logits.append(out.clone())
        return out

    model.logits = recording_logits
    if model.decode_stack is not None:
        native_forward = model.decode_stack.forward

        def counted(*args):
            stack_calls[0] += 1
            return native_forward(*args)

        model.decode_stack.forward = counted
    llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    return seen, stack_calls[0], model.decode_stack is not None


@pytest.mark.parametrize(
    "config",
    [
        dict(dtype="bfloat16"),  # bf16 pairs
        dict(dtype="bfloat16", quantization="int8"),  # int8 codes, int16 activation codes
        dict(dtype="float32"),  # float32 columns
    ],
    ids=["bf16", "int8", "float32"],
)
def test_the_stack_gives_the_same_bits_as_the_layers(monkeypatch, llama_hd64, config):
    stacked, calls, built = decode_hiddens(monkeypatch, llama_hd64, True, **config)
    stacked_logits = list(seen_logits)
    plain, plain_calls, plain_built = decode_hiddens(monkeypatch, llama_hd64, False, **config)
    assert built and not plain_built and plain_calls == 0
    assert calls == len(stacked) >= 11  # every decode-only step went through it
    assert len(stacked) == len(plain)
    for a, b in zip(stacked, plain, strict=True):
        assert torch.equal(a, b)
    # The stack ran the final norm and the LM head too: the same logits as the head's call.
    assert len(stacked_logits) == len(seen_logits) > len(stacked)
    for a, b in zip(stacked_logits, seen_logits, strict=True):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)


def test_the_logits_of_a_stacked_step_are_handed_out_once(monkeypatch, llama_hd64):
    """DecoderModel.logits gives the stack's logits for the very rows the forward returned,
    once: asked again (the sampler's retry) or for other rows, it multiplies afresh."""
    monkeypatch.setenv(decode_stack.ENV_SWITCH, "1")
    llm = LLM(model=str(llama_hd64), max_total_tokens=4096, page_size=16, dtype="bfloat16", quantization="int8")
    model = llm.engine.model
    heads = [0]
    apply_linear = model.backend.apply_linear

    def counting(x, w, residual=None):
        if w is model.lm_head:
            heads[0] += 1
        return apply_linear(x, w, residual)

    model.backend.apply_linear = counting
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert heads[0] == 1  # the prompt's step; its three decode steps took the stack's logits
    hidden = torch.randn(2, 256).to(torch.bfloat16)
    model._step_logits = (hidden, torch.zeros(2, 7))
    assert model.logits(hidden[:1]).shape[1] == llm.engine.model_config.vocab_size  # other rows: the head
    assert heads[0] == 2 and model._step_logits is None
    model._step_logits = (hidden, torch.ones(2, 7))
    assert torch.equal(model.logits(hidden), torch.ones(2, 7))  # the same rows: handed out
    assert model.logits(hidden).shape[1] == llm.engine.model_config.vocab_size  # then multiplied afresh
    assert heads[0] == 3


class RepeatDrafter:
    """Drafts the last token again, 1 to 4 times by the context's length: a draft every
    step, of varied lengths, whatever the random model says."""

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        return [token_ids[-1]] * min(num_tokens, 1 + len(token_ids) % 4)


def verify_steps(monkeypatch, model_dir, stacked: bool, rows: int) -> tuple[list[torch.Tensor], list[list[int]], int]:
    """The final hidden states of every speculative verify step of three greedy requests
    (a draft every step, `always`), their outputs, and how many verify steps the stack ran. Off the stack a verify step's attention runs as decode rows here (the extend
    kernel is kept out), the form the stack runs it in."""
    monkeypatch.setenv(decode_stack.ENV_SWITCH, "1" if stacked else "0")
    monkeypatch.setattr(decode_stack, "VERIFY_ROWS", rows)
    monkeypatch.setattr(cpu_attention, "EXTEND_KERNEL_MIN_FILL", {16: 17, 8: 9})  # no lanes fill: decode rows
    llm = LLM(model=str(model_dir), max_total_tokens=4096, page_size=16, dtype="bfloat16",
              speculative_method="ngram", speculative_gate="always", num_speculative_tokens=4)  # fmt: skip
    llm.engine.speculator.drafter = RepeatDrafter()
    model = llm.engine.model
    seen: list[torch.Tensor] = []
    stack_calls = [0]
    forward = model.forward

    def recording(input_ids, meta, kv_pool):
        out = forward(input_ids, meta, kv_pool)
        if meta.verify_only:
            seen.append(out.clone())
        return out

    model.forward = recording
    if model.decode_stack is not None:
        native_forward = model.decode_stack.forward

        def counted(hidden, ctx, kv_pool, rows):
            stack_calls[0] += ctx.meta.verify_only
            return native_forward(hidden, ctx, kv_pool, rows)

        model.decode_stack.forward = counted
    prompts = [list(range(300, 316)) * 4, list(range(1000, 1010)) * 5, [7, 8, 9] * 9]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    return seen, [o.token_ids for o in outs], stack_calls[0]


def test_verify_steps_run_on_the_stack_as_decode_rows_with_the_same_bits(monkeypatch, llama_hd64):
    stacked, stacked_out, calls = verify_steps(monkeypatch, llama_hd64, True, rows=64)
    plain, plain_out, _ = verify_steps(monkeypatch, llama_hd64, False, rows=64)
    assert calls == len(stacked) > 0  # every verify step went through the stack
    assert stacked_out == plain_out and len(stacked) == len(plain)
    for a, b in zip(stacked, plain, strict=True):
        assert torch.equal(a, b)
    # With VERIFY_ROWS 0 the verify steps leave the stack, as before
    _, off_out, off_calls = verify_steps(monkeypatch, llama_hd64, True, rows=0)
    assert off_calls == 0 and off_out == plain_out


def test_biases_ride_along(monkeypatch, qwen2):
    stacked, calls, built = decode_hiddens(monkeypatch, qwen2, True, dtype="bfloat16")
    plain, _, _ = decode_hiddens(monkeypatch, qwen2, False, dtype="bfloat16")
    assert built and calls > 0
    assert all(torch.equal(a, b) for a, b in zip(stacked, plain, strict=True))


def test_layers_it_does_not_run_keep_the_old_path(monkeypatch, qwen3, smollm_tokenizer, tmp_path):
    _, calls, built = decode_hiddens(monkeypatch, qwen3, True, dtype="bfloat16")
    assert not built and calls == 0
    # head_dim 16: the rotary table kernel takes multiples of 32, so no step is the stack's
    narrow = build_tiny_model(tmp_path / "narrow", "llama", smollm_tokenizer)
    stacked, calls, built = decode_hiddens(monkeypatch, narrow, True, dtype="bfloat16")
    plain, _, _ = decode_hiddens(monkeypatch, narrow, False, dtype="bfloat16")
    assert built and calls == 0
    assert all(torch.equal(a, b) for a, b in zip(stacked, plain, strict=True))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_cache_is_taken_with_the_bits_of_the_layers(monkeypatch, llama_hd64, kv_cache_dtype):
    """An fp8 pool's steps run on the stack too: it writes K/V with each layer's calibrated
    scales and reads them back as the layers' decode attention does (the scales handed over
    with the pool's views), so every step gives the bits of the layers one call at a time."""
    config = dict(dtype="bfloat16", quantization="int8", kv_cache_dtype=kv_cache_dtype)
    stacked, calls, built = decode_hiddens(monkeypatch, llama_hd64, True, **config)
    plain, _, _ = decode_hiddens(monkeypatch, llama_hd64, False, **config)
    assert built and calls == len(stacked) >= 11
    assert len(stacked) == len(plain)
    assert all(torch.equal(a, b) for a, b in zip(stacked, plain, strict=True))


def test_a_rebuilt_native_stack_is_handed_the_pools_fp8_scales():
    """weight_arena swaps a new native stack in after the weights move (it holds raw
    pointers): the new one must get the pool's scales before its first step, not only the
    first native stack (it failed that step with 'fp8 caches need their scales')."""
    events: list[tuple[str, object]] = []

    class Native:
        num_layers, has_head = 2, False

        def __init__(self, name: str) -> None:
            self.name = name

        def set_kv_scales(self, scales) -> None:
            events.append((self.name, scales))

        def forward(self, *args):
            events.append((self.name, "forward"))
            return args[0]

    scales = torch.ones(2, 2, 1)
    pool = SimpleNamespace(k=lambda i: torch.zeros(1), v=lambda i: torch.zeros(1), scales=scales)
    ctx = SimpleNamespace(meta=SimpleNamespace(slots=None), rope=SimpleNamespace(table=None, positions=None))
    stack = decode_stack.DecodeStack(Native("first"), torch.bfloat16, None)
    rows = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    for _ in range(2):
        stack.forward(torch.zeros(1, 4), ctx, pool, rows)
    stack.native = Native("rebuilt")
    stack.forward(torch.zeros(1, 4), ctx, pool, rows)
    assert events == [("first", scales), ("first", "forward"), ("first", "forward"),
                      ("rebuilt", scales), ("rebuilt", "forward")]


@pytest.mark.parametrize(
    "config",
    [dict(dtype="bfloat16"), dict(dtype="bfloat16", quantization="int8"), dict(dtype="float32"),
     dict(dtype="bfloat16", quantization="int8", int8_activation_bits=8), dict(dtype="bfloat16", kv_cache_dtype="fp8")],
    ids=["bf16", "int8", "float32", "int8-8bit-activations", "bf16-fp8-cache"],
)
def test_one_parallel_region_gives_the_bits_of_one_call_at_a_time(monkeypatch, llama_hd64, config):
    """forward runs the step's layers in one parallel region (forward_team, the threads
    meeting at a barrier between phases); forward_calls one entry point after another. With
    1, 2 or 3 threads (more threads than this machine's cores included) both give the same
    hidden states and write the same K/V; with the final norm and the LM head as the region's
    last phases (forward_logits), the same normed rows and logits as rms_norm and the head's
    product called after the layers (forward_logits_calls)."""
    if config.get("int8_activation_bits") == 8 and 8 not in kernels.int8_activation_bits_choices:
        pytest.skip("8-bit activation codes need the AVX-512 VNNI build")  # the AVX2 build runs 16 only
    monkeypatch.setenv(decode_stack.ENV_SWITCH, "1")
    llm = LLM(model=str(llama_hd64), max_total_tokens=4096, page_size=16, **config)
    stack = llm.engine.model.decode_stack
    assert stack is not None and stack.native.has_head
    native, captured = stack.native, []

    class Recorder:
        num_layers = native.num_layers
        has_head = True

        def set_kv_scales(self, scales):
            native.set_kv_scales(scales)

        def forward_logits(self, *args):
            if len(captured) < 3:
                captured.append(args)
            return native.forward_logits(*args)

    stack.native = Recorder()
    llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    stack.native = native
    assert captured
    threads = torch.get_num_threads()
    try:
        for args in captured:
            rows = args[0].shape[0]
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                one_at_a_time = native.forward_calls(*args)
                caches = [c.clone().view(torch.uint8) for c in args[4] + args[5]]  # fp8 caches compared as bytes
                together = native.forward(*args)
                assert together.shape == (rows, args[0].shape[1])
                assert torch.equal(together, one_at_a_time), f"{n} threads"
                normed_calls, logits_calls = native.forward_logits_calls(*args)
                normed, logits = native.forward_logits(*args)
                assert logits.shape == (rows, llm.engine.model_config.vocab_size)
                assert torch.equal(normed, normed_calls) and torch.equal(logits, logits_calls), f"{n} threads"
                assert all(torch.equal(c, d.view(torch.uint8)) for c, d in zip(caches, args[4] + args[5], strict=True))
    finally:
        torch.set_num_threads(threads)
