"""The batched extend attention (engine/kernels/batched_extend.py) computes what the
per-sequence reference computes, and is only chosen when padding wastes little.

Tolerance: both sides run SDPA in float32 on the same inputs; only summation order differs.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from preheat.engine.kernels import attention, batched_extend, reference

PAGE_SIZE = 4
NUM_PAGES = 96


def pool_and_table(prompt_lens: list[int], kv_heads: int, head_dim: int, seed: int, shared_pages: int = 0):
    """A random pool; sequences' pages scattered over it, the first `shared_pages` the same
    pages for every sequence (as the radix cache hands out a shared system prompt)."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_PAGES, PAGE_SIZE, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(NUM_PAGES, PAGE_SIZE, kv_heads, head_dim, generator=gen)
    free = (torch.randperm(NUM_PAGES - 1, generator=gen) + 1).tolist()  # page 0 is scratch
    common = [free.pop() for _ in range(shared_pages)]
    width = max(math.ceil(n / PAGE_SIZE) for n in prompt_lens) + 1
    table = torch.zeros(len(prompt_lens), width, dtype=torch.int32)
    for row, n in enumerate(prompt_lens):
        own = [free.pop() for _ in range(math.ceil(n / PAGE_SIZE) - shared_pages)]
        table[row, : math.ceil(n / PAGE_SIZE)] = torch.tensor(common + own)
    return k_cache, v_cache, table, gen


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    num_seqs=st.integers(1, 5),
    heads=st.sampled_from([(4, 4), (4, 1), (8, 2)]),
    seed=st.integers(0, 2**16),
)
def test_matches_the_per_sequence_reference(data, num_seqs, heads, seed):
    num_heads, kv_heads = heads
    shared = data.draw(st.integers(0, 3))
    totals = data.draw(st.lists(st.integers(shared * PAGE_SIZE + 1, 40), min_size=num_seqs, max_size=num_seqs))
    extends = [data.draw(st.integers(1, t)) for t in totals]
    prefixes = [t - e for t, e in zip(totals, extends)]
    k_cache, v_cache, table, gen = pool_and_table(totals, kv_heads, 8, seed, shared)
    q = torch.randn(sum(extends), num_heads, 8, generator=gen)

    want = reference.extend_attention(q, k_cache, v_cache, table, prefixes, extends, 0.35)
    plan = batched_extend.plan_extend(table, prefixes, extends, PAGE_SIZE)
    got = batched_extend.extend_attention(q, k_cache, v_cache, plan, 0.35)

    torch.testing.assert_close(got, want)


def test_new_turns_of_many_conversations_are_batched():
    # 16 conversations, each ~30 new tokens over a ~350-token history: the shape of a
    # multi-turn chat step, where the per-sequence loop dominated the step on CPU.
    prefixes = [350 + 7 * i for i in range(16)]
    extends = [25 + (i % 5) * 6 for i in range(16)]
    assert batched_extend.worth_batching(prefixes, extends)


@pytest.mark.parametrize(
    "prefixes, extends, why",
    [
        ([0], [300], "a single sequence has nothing to batch"),
        ([0, 4000], [500, 1], "one long prompt beside a short one: padding would multiply the work"),
        ([0] * 8, [4000] * 8, "the mask alone would take too much memory"),
    ],
)
def test_falls_back_to_the_reference_when_padding_does_not_pay(prefixes, extends, why):
    assert not batched_extend.worth_batching(prefixes, extends), why
    table = torch.zeros(len(extends), 1, dtype=torch.int32)
    assert attention.prepare_extend(table, prefixes, extends, PAGE_SIZE) is None


def test_padding_rows_never_reach_the_output():
    k_cache, v_cache, table, gen = pool_and_table([9, 3, 14], 2, 8, seed=7)
    prefixes, extends = [5, 0, 2], [4, 3, 12]
    q = torch.randn(sum(extends), 4, 8, generator=gen)
    plan = batched_extend.plan_extend(table, prefixes, extends, PAGE_SIZE)
    assert plan.rows == 12 and plan.keys == 14
    assert plan.unpad_index.tolist() == [0, 1, 2, 3] + [12, 13, 14] + list(range(24, 36))
    out = batched_extend.extend_attention(q, k_cache, v_cache, plan, 0.35)
    assert out.shape == q.shape and torch.isfinite(out).all()
