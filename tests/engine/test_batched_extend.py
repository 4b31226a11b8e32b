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

from preheat.engine.kernels import batched_extend, reference
from preheat.engine.kernels.torch_backend import TorchBackend

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
        ([0] * 7, [1, 3, 9, 27, 81, 243, 729], "lengths too spread for MAX_GROUPS groups: padding would multiply the work"),
        ([0] * 8, [4000] * 8, "the mask alone would take too much memory"),
    ],
)
def test_falls_back_to_the_reference_when_padding_does_not_pay(prefixes, extends, why):
    assert not batched_extend.worth_batching(prefixes, extends), why
    table = torch.zeros(len(extends), 1, dtype=torch.int32)
    assert TorchBackend().prepare_extend(table, prefixes, extends, PAGE_SIZE) is None


def test_sequences_of_similar_length_share_a_group():
    # Two clusters of extend lengths: padding the short ones to the long ones would do
    # ~4x the work, so they become two groups (two SDPA calls), each padded only a little.
    prefixes = [300] * 6
    extends = [10, 60, 11, 12, 58, 61]
    groups = batched_extend.group_by_length(prefixes, extends)
    assert sorted(map(sorted, groups)) == [[0, 2, 3], [1, 4, 5]]
    for group in groups:
        real, padded = batched_extend._work(group, prefixes, extends)
        assert padded <= batched_extend.GROUP_SLACK * real


def test_never_more_than_max_groups():
    extends = [2**i for i in range(10)]
    groups = batched_extend.group_by_length([0] * 10, extends)
    assert len(groups) == batched_extend.MAX_GROUPS
    assert sorted(i for g in groups for i in g) == list(range(10))


def test_rows_come_back_in_their_original_order_without_padding():
    k_cache, v_cache, table, gen = pool_and_table([9, 3, 14, 40], 2, 8, seed=7)
    prefixes, extends = [5, 0, 2, 0], [4, 3, 12, 40]
    q = torch.randn(sum(extends), 4, 8, generator=gen)
    plan = batched_extend.plan_extend(table, prefixes, extends, PAGE_SIZE)
    assert len(plan.groups) > 1 and plan.order is not None  # the lengths differ too much for one group
    assert sum(g.unpad_index.numel() for g in plan.groups) == sum(extends)
    out = batched_extend.extend_attention(q, k_cache, v_cache, plan, 0.35)
    want = reference.extend_attention(q, k_cache, v_cache, table, prefixes, extends, 0.35)
    torch.testing.assert_close(out, want)
