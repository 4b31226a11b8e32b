"""The CPU kernels' matrices in one huge-page mapping (engine/model/weight_arena.py): every
packed tensor moves, bytes and sharing kept, the mapping advised for 2 MiB pages; nothing
moves where huge pages are off, when memory is short or when the copy fails; what is
already in an arena stays; an engine copies them in the background, swaps them in at a
step's start and serves the same tokens."""

from __future__ import annotations

import sys

import pytest
import torch

from preheat.engine import LLM, SamplingParams
from preheat.engine.kernels import cpu_ext, linear
from preheat.engine.kernels.linear import LinearWeight
from preheat.engine.model import weight_arena

ON = {"PREHEAT_HUGE_PAGES": "1"}


def int8_weight(n: int = 48, k: int = 64, seed: int = 0, bias: bool = True) -> LinearWeight:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 255, (n // 16, k // 2, 16, 2), generator=g, dtype=torch.uint8)
    scales = torch.randn(n // 16, k // 32, 2, 16, generator=g).to(torch.float16)
    return LinearWeight(n, k, "int8", packed=packed, scales=scales,
                        bias=torch.randn(n, generator=g).to(torch.bfloat16) if bias else None)  # fmt: skip


def advised(address: int) -> bool:
    """Whether the mapping holding `address` is marked for huge pages (smaps' VmFlags `hg`)."""
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = lo <= address < hi
            elif head == "VmFlags:" and current:
                return "hg" in line.split()[1:]
    return False


def test_every_packed_tensor_moves_with_its_bytes_and_sharing():
    a, b = int8_weight(seed=1), int8_weight(seed=2, bias=False)
    b.scales = a.scales  # shared between two weights: stays one tensor
    dense = LinearWeight(16, 32, "dense", weight=torch.randn(16, 32))
    before = {(id(w), name): getattr(w, name).clone() for w in (a, b) for name in ("packed", "scales", "bias")
              if getattr(w, name) is not None}  # fmt: skip
    dense_weight = dense.weight
    made = weight_arena.copies([a, b, dense, a], environ=ON, setting="madvise")
    assert made is not None
    arena, assignments = made
    assert weight_arena.holder(a.packed) is None  # copies only, until applied
    weight_arena.apply(assignments)
    assert arena is not None and arena.tensors == 4  # a: packed, scales, bias; b: packed (its scales are a's)
    for (wid, name), old in before.items():
        w = a if wid == id(a) else b
        t = getattr(w, name)
        assert weight_arena.holder(t) is arena and torch.equal(t, old) and t.is_contiguous()
        assert arena.base <= t.data_ptr() < arena.base + arena.nbytes and t.data_ptr() % weight_arena.ALIGN == 0
    assert b.scales.data_ptr() == a.scales.data_ptr()
    assert dense.weight is dense_weight  # not a packed kind: left alone
    assert arena.base % weight_arena.HUGE_PAGE == 0
    if sys.platform.startswith("linux"):
        assert advised(arena.base)
    # Already in an arena: nothing more to copy.
    assert weight_arena.copies([a, b], environ=ON, setting="madvise") is None


@pytest.mark.parametrize("environ,setting,reason", [
    ({"PREHEAT_HUGE_PAGES": "0"}, "madvise", "PREHEAT_HUGE_PAGES=0"),
    (ON, "never", "transparent huge pages are never"),
    (ON, None, "transparent huge pages are unavailable"),
])  # fmt: skip
def test_nothing_moves_where_huge_pages_are_off(environ, setting, reason, monkeypatch, tmp_path):
    monkeypatch.setattr(weight_arena, "THP_SETTING", tmp_path / "missing")  # `None`: the file is unreadable
    w = int8_weight()
    packed = w.packed
    assert weight_arena.why_not(environ, setting) == reason
    assert weight_arena.copies([w], environ=environ, setting=setting) is None
    assert w.packed is packed


def test_on_by_default_where_the_kernel_offers_huge_pages():
    assert weight_arena.why_not({}, "always") is None and weight_arena.why_not({}, "madvise") is None


def test_no_move_that_would_take_more_than_half_the_memory_left():
    w = int8_weight()
    packed = w.packed
    assert weight_arena.copies([w], environ=ON, setting="madvise", headroom=packed.numel()) is None
    assert w.packed is packed
    made = weight_arena.copies([w], environ=ON, setting="madvise", headroom=1 << 30)
    assert made is not None and w.packed is packed  # copies only: the weight still has its own
    weight_arena.apply(made[1])
    assert weight_arena.holder(w.packed) is made[0] and torch.equal(w.packed, packed)


def test_the_kernel_setting_is_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert weight_arena.thp_setting(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert weight_arena.thp_setting(f) == "always"
    assert weight_arena.thp_setting(tmp_path / "missing") is None


def test_an_arena_refuses_more_than_it_holds():
    arena = weight_arena.Arena(128)
    arena.place(torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="full"):
        arena.place(torch.zeros(64, dtype=torch.uint8))


class FakeModel:
    def __init__(self, weights: list[LinearWeight]) -> None:
        self.weights, self.weight_arena, self.decode_stack = weights, None, None

    def matrices(self) -> list[LinearWeight]:
        return self.weights


def test_a_failed_copy_leaves_the_weights_where_they_are(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise MemoryError("no room")

    monkeypatch.setattr(weight_arena, "copies", broken)
    model = FakeModel([int8_weight()])
    packed = model.weights[0].packed
    move = weight_arena.WeightMove(model, environ=ON)
    move.start()
    assert move.moving and move.wait(10)
    assert not move.apply_if_done() and move.finished
    assert model.weights[0].packed is packed and model.weight_arena is None
    assert "moving them into huge pages failed" in caplog.text


@pytest.mark.skipif(cpu_ext.load() is None, reason="packed matrices are the CPU kernels'")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_an_engine_swaps_its_matrices_in_at_a_step_and_serves_the_same_tokens(tiny_llama_dir, monkeypatch,
                                                                              kv_cache_dtype):
    """With an fp8 pool too: the rebuilt native stack gets the pool's scales (it failed its
    first step after the swap when only the first native one had been handed them)."""
    prompts, params = [[5, 17, 300, 42, 9], list(range(100, 150))], SamplingParams(max_tokens=8, temperature=0)
    monkeypatch.setenv("PREHEAT_HUGE_PAGES", "0")
    llm = LLM(model=str(tiny_llama_dir), weight_cache_dir="off", max_total_tokens=512, page_size=4,
              kv_cache_dtype=kv_cache_dtype)
    assert not llm.engine.weight_move.moving and llm.engine.model.weight_arena is None
    expected = [r.token_ids for r in llm.generate(prompts, params)]
    del llm
    monkeypatch.setenv("PREHEAT_HUGE_PAGES", "1")
    llm = LLM(model=str(tiny_llama_dir), weight_cache_dir="off", max_total_tokens=512, page_size=4,
              kv_cache_dtype=kv_cache_dtype)
    model, move = llm.engine.model, llm.engine.weight_move
    if weight_arena.why_not() is not None:  # this machine gives no huge pages: nothing moves
        assert not move.moving
        return
    assert move.moving and move.wait(30)  # LLM(...) started it, as a server does once ready
    assert model.weight_arena is None  # copied, not yet in use: only a step swaps them in
    stack = model.decode_stack
    old_native = stack.native if stack is not None else None
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected
    assert move.applied
    assert model.weight_arena is not None
    for w in model.matrices():  # every matrix a step multiplies by, the LM head too
        assert all(weight_arena.holder(t) is model.weight_arena for t in linear.stored(w).values())
    if stack is not None:  # the same stack object, its native one rebuilt over the new tensors
        assert model.decode_stack is stack and stack.native is not old_native
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected


def test_finish_puts_the_weights_in_place_before_the_next_step(tiny_llama_dir, monkeypatch):
    """What a benchmark stepping an Engine itself calls: the move started, copied and swapped
    in by the time it returns (LLM(...) and a server only start it)."""
    monkeypatch.setenv("PREHEAT_HUGE_PAGES", "1")
    llm = LLM(model=str(tiny_llama_dir), weight_cache_dir="off", max_total_tokens=512, page_size=4)
    model, move = llm.engine.model, llm.engine.weight_move
    placed = move.finish(30)
    if weight_arena.why_not() is not None:  # this machine gives no huge pages: nothing moves
        assert not placed and model.weight_arena is None
        return
    assert placed and move.applied and move.finished
    for w in model.matrices():
        assert all(weight_arena.holder(t) is model.weight_arena for t in linear.stored(w).values())
    assert move.finish(30)  # again: nothing more to do, still in place
