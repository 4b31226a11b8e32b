"""The step planner, driven without a model: who decodes, who prefills how much, who is
admitted, who is preempted, and how many pages each must get."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from preheat.engine.sched.plan import (
    SHARED_PREFIX_CHECK_TOKENS,
    SeqView,
    StepPlan,
    next_tokens_key,
    pages_for,
    plan_step,
)

PS = 4


def decoding(seq_id: str, num_tokens: int, reclaimable: int | None = None) -> SeqView:
    """A running sequence whose KV covers every token but the last sampled one."""
    pages = pages_for(num_tokens - 1, PS)
    return SeqView(seq_id, num_tokens, num_tokens - 1, pages, pages if reclaimable is None else reclaimable)


def prefilling(seq_id: str, num_tokens: int, num_computed: int) -> SeqView:
    pages = pages_for(num_computed, PS)
    return SeqView(seq_id, num_tokens, num_computed, pages, pages)


def waiting(seq_id: str, num_tokens: int, cached_len: int = 0, next_tokens: int | None = None) -> SeqView:
    return SeqView(seq_id, num_tokens, 0, 0, 0, cached_len, next_tokens_key=next_tokens)


def plan(
    running: list[SeqView] = (),  # type: ignore[assignment]
    queue: list[SeqView] = (),  # type: ignore[assignment]
    free_pages: int = 100,
    max_num_seqs: int = 64,
    chunk_budget: int = 512,
    page_size: int = PS,
) -> StepPlan:
    return plan_step(list(running), list(queue), free_pages, page_size, max_num_seqs, chunk_budget)


# --- decodes ----------------------------------------------------------------------------------


def test_nothing_to_do_is_an_empty_plan() -> None:
    p = plan()
    assert p.empty and p == StepPlan()


def test_each_decode_gets_one_token_and_a_page_only_when_it_crosses_a_page_boundary() -> None:
    # "a" has 4 tokens of KV (one full page) and its 5th token starts page two;
    # "b" has 5 tokens of KV and its 6th token still fits in page two.
    p = plan([decoding("a", 5), decoding("b", 6)])
    assert p.decode == ["a", "b"]
    assert p.pages == {"a": 1, "b": 0}
    assert p.extend == [] and p.admit == [] and p.preempt == []


def test_a_first_decode_after_a_page_aligned_prompt_needs_a_page() -> None:
    p = plan([decoding("a", 9)])  # 8 tokens of KV fill two pages exactly
    assert p.pages == {"a": 1}


# --- chunked prefill ----------------------------------------------------------------------------


def test_a_long_prompt_is_split_into_chunks_of_the_budget() -> None:
    p = plan(queue=[waiting("long", 100)], chunk_budget=32)
    assert p.admit == ["long"]
    assert p.extend == [("long", 32)]
    assert p.pages == {"long": 8}


def test_a_partially_prefilled_sequence_continues_before_new_admissions() -> None:
    p = plan([prefilling("long", 100, 32)], [waiting("new", 10)], chunk_budget=32)
    assert p.extend == [("long", 32)]
    assert p.admit == []  # the budget went to the sequence already part-way through
    assert p.pages == {"long": 8}


def test_the_budget_left_after_a_prefill_continuation_goes_to_admissions() -> None:
    p = plan([prefilling("long", 100, 90)], [waiting("new", 40)], chunk_budget=32)
    assert p.extend == [("long", 10), ("new", 22)]
    assert p.admit == ["new"]


def test_the_last_chunk_is_only_what_is_left() -> None:
    p = plan([prefilling("long", 100, 96)], chunk_budget=32)
    assert p.extend == [("long", 4)]
    assert p.pages == {"long": 1}


def test_decodes_run_alongside_prefill_chunks_and_do_not_use_the_token_budget() -> None:
    p = plan([decoding("d1", 10), decoding("d2", 20)], [waiting("w", 64)], chunk_budget=16)
    assert p.decode == ["d1", "d2"]
    assert p.extend == [("w", 16)]


def test_a_prefill_short_of_pages_computes_what_its_pages_can_hold() -> None:
    # 30 of 100 tokens done in 8 pages (32 slots); 1 page free: 32 + 4 - 30 = 6 tokens fit.
    p = plan([prefilling("long", 100, 30)], free_pages=1, chunk_budget=64)
    assert p.extend == [("long", 6)]
    assert p.pages == {"long": 1}


# --- admission ---------------------------------------------------------------------------------


def test_admission_is_first_come_first_served_and_stops_at_the_first_that_does_not_fit() -> None:
    # "big" needs 10 pages, only 5 are free: "small" (1 page) may not jump ahead of it.
    p = plan(queue=[waiting("big", 40), waiting("small", 3)], free_pages=5)
    assert p.admit == [] and p.extend == []


def test_admission_takes_requests_in_arrival_order_while_they_fit() -> None:
    p = plan(queue=[waiting("a", 8), waiting("b", 8), waiting("c", 8)], free_pages=5)
    assert p.admit == ["a", "b"]  # 2 + 2 pages; "c" needs 2 more, 1 is left
    assert p.extend == [("a", 8), ("b", 8)]
    assert p.pages == {"a": 2, "b": 2}


def test_max_num_seqs_caps_running_plus_admitted() -> None:
    p = plan([decoding("r1", 5), decoding("r2", 5)], [waiting(f"w{i}", 4) for i in range(3)], max_num_seqs=3)
    assert p.admit == ["w0"]
    p = plan([decoding("r1", 5), decoding("r2", 5)], [waiting("w0", 4)], max_num_seqs=2)
    assert p.admit == []


def test_cached_prefix_tokens_are_neither_computed_nor_given_pages() -> None:
    # 16 of 21 prompt tokens come from the prefix cache (4 pages it already holds):
    # 5 tokens to compute, in pages 5 and 6.
    p = plan(queue=[waiting("w", 21, cached_len=16)])
    assert p.extend == [("w", 5)]
    assert p.pages == {"w": 2}
    uncached = plan(queue=[waiting("w", 21)])
    assert uncached.pages == {"w": 6}


def test_an_admission_whose_prefix_grew_is_rebased_in_the_plan() -> None:
    # Planned from 4 cached tokens: 17 to compute, 5 pages. Admitting brought 8 more tokens
    # back from L2/L3 (2 pages): the rest of the prompt, 9 tokens, needs 3 new pages.
    p = plan(queue=[waiting("w", 21, cached_len=4), waiting("x", 6)])
    assert p.extend == [("w", 17), ("x", 6)] and p.pages == {"w": 5, "x": 2}
    assert p.rebase_admission("w", num_tokens=21, num_computed=12, num_pages=3, page_size=PS) == 9
    assert p.extend == [("w", 9), ("x", 6)] and p.pages == {"w": 3, "x": 2}
    # A chunk shorter than the rest keeps its length and starts later.
    c = plan(queue=[waiting("w", 21)], chunk_budget=8)
    assert c.extend == [("w", 8)] and c.pages == {"w": 2}
    assert c.rebase_admission("w", num_tokens=21, num_computed=8, num_pages=2, page_size=PS) == 8
    assert c.extend == [("w", 8)] and c.pages == {"w": 2}


def test_admitting_locks_the_cached_prefix_so_its_evictable_pages_stop_counting_as_free() -> None:
    # free_pages counts evictable cache pages; 4 of them are the very prefix "w" would lock.
    # Counting them as room for w's new page (and the decode's) would leave the decode
    # without a page once w is admitted, and the engine would preempt it.
    running = [decoding("d", 25)]  # needs a page this step
    w = SeqView("w", 20, 0, 0, 0, cached_len=16, cached_evictable_pages=4)
    assert plan(running, [w], free_pages=4).admit == []
    assert plan(running, [w], free_pages=7).admit == ["w"]  # 1 for d, 1 for w, 4 locked, 1 spare for d
    shared = SeqView("w", 20, 0, 0, 0, cached_len=16, cached_evictable_pages=0)  # already locked by others
    assert plan(running, [shared], free_pages=4).admit == ["w"]


def test_admission_leaves_a_page_per_decode_so_the_next_step_need_not_preempt() -> None:
    # Two decodes need no page now; the request needs 2 of the 3 free pages, which would
    # leave one page for two decodes that may each cross a page boundary next step.
    running = [decoding("d1", 6), decoding("d2", 7)]
    assert plan(running, [waiting("w", 8)], free_pages=3).admit == []
    assert plan(running, [waiting("w", 8)], free_pages=4).admit == ["w"]


# --- preemption ---------------------------------------------------------------------------------


def test_when_decodes_do_not_fit_the_newest_admitted_are_preempted_and_nothing_is_admitted() -> None:
    # Three decodes each need a page, one page is free. Preempting "c" (newest) gives back
    # its 2 pages: 3 free for "a" and "b" who need 2.
    running = [decoding("a", 9), decoding("b", 9), decoding("c", 9)]
    p = plan(running, [waiting("w", 2)], free_pages=1)
    assert p.preempt == ["c"]
    assert p.decode == ["a", "b"]
    assert p.pages == {"a": 1, "b": 1}
    assert p.admit == [] and p.extend == []  # the pool is under pressure: no admissions


def test_a_step_that_preempts_admits_nothing_even_when_the_victim_freed_plenty() -> None:
    # "big" gives back 10 pages, far more than "a" needs; admitting "w" with them would only
    # make the next step preempt again.
    running = [decoding("a", 9), decoding("big", 41)]
    p = plan(running, [waiting("w", 2)], free_pages=1)
    assert p.preempt == ["big"]
    assert p.decode == ["a"]
    assert p.admit == [] and p.extend == []


def test_preemption_goes_newest_first_until_the_rest_fit() -> None:
    running = [decoding("a", 9, reclaimable=0), decoding("b", 9, reclaimable=0), decoding("c", 9, reclaimable=0)]
    p = plan(running, free_pages=1)  # preempting gives nothing back: only "a" can continue
    assert p.preempt == ["c", "b"]
    assert p.decode == ["a"]


def test_a_preempted_prefilling_sequence_does_not_continue_its_prefill() -> None:
    running = [decoding("a", 9), prefilling("p", 50, 20)]
    p = plan(running, free_pages=0)
    assert p.preempt == ["p"]
    assert p.decode == ["a"] and p.extend == []


def test_a_lone_sequence_that_the_pool_cannot_grow_is_not_scheduled() -> None:
    p = plan([decoding("a", 9)], free_pages=0)
    assert p.empty and p.pages == {} and p.preempt == []


# --- purity ---------------------------------------------------------------------------------------


def test_a_request_whose_next_tokens_another_computes_this_step_waits_a_step() -> None:
    # a and b start with the same uncached system prompt; c with another one.
    p = plan(queue=[waiting("a", 100, next_tokens=1), waiting("b", 100, next_tokens=1),
                    waiting("c", 100, next_tokens=2)])
    assert p.admit == ["a", "c"] and p.deferred == ["b"]


def test_a_request_waits_for_a_running_sequence_part_way_through_the_same_prefix() -> None:
    running = [SeqView("r", 600, 512, pages_for(512, PS), pages_for(512, PS), next_tokens_key=7)]
    p = plan(running, [waiting("w", 600, cached_len=512, next_tokens=7)])
    assert p.extend == [("r", 88)] and p.deferred == ["w"] and not p.admit


def test_requests_without_a_key_are_never_deferred() -> None:
    p = plan(queue=[waiting("a", 100), waiting("b", 100)])
    assert p.admit == ["a", "b"] and not p.deferred


def test_the_key_names_tokens_and_their_position_and_needs_enough_of_them() -> None:
    tokens = list(range(100))
    n = SHARED_PREFIX_CHECK_TOKENS
    assert next_tokens_key(tokens, 16, 100) == next_tokens_key(tokens[:16] + tokens[16:], 16, 100)
    assert next_tokens_key(tokens, 16, 100) != next_tokens_key(tokens, 32, 100)
    assert next_tokens_key(tokens, 16, 100) != next_tokens_key(tokens[:20] + [7] + tokens[21:], 16, 100)
    assert next_tokens_key(tokens, 100 - n, 100) is not None
    assert next_tokens_key(tokens, 100 - n + 1, 100) is None


def test_the_planner_is_pure_same_inputs_same_plan_and_inputs_untouched() -> None:
    running = [decoding("a", 9), decoding("b", 5), prefilling("p", 100, 40)]
    queue = [waiting("w1", 30, cached_len=8), waiting("w2", 3)]
    snapshot = (copy.deepcopy(running), copy.deepcopy(queue))
    first = plan(running, queue, free_pages=6, chunk_budget=48)
    second = plan(running, queue, free_pages=6, chunk_budget=48)
    assert first == second
    assert (running, queue) == snapshot


# --- properties over random states -------------------------------------------------------------


@st.composite
def states(draw: st.DrawFn) -> dict:
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    running = []
    for i in range(draw(st.integers(0, 8))):
        num_tokens = draw(st.integers(1, 200))
        num_computed = draw(st.integers(0, num_tokens - 1))
        pages = pages_for(num_computed, page_size)
        reclaimable = draw(st.integers(0, pages))
        running.append(SeqView(f"r{i}", num_tokens, num_computed, pages, reclaimable))
    queue = []
    for i in range(draw(st.integers(0, 8))):
        num_tokens = draw(st.integers(1, 200))
        # The cache serves whole pages and never the prompt's last token (its logits are needed).
        cached = draw(st.integers(0, (num_tokens - 1) // page_size)) * page_size
        evictable = draw(st.integers(0, cached // page_size))
        queue.append(SeqView(f"w{i}", num_tokens, 0, 0, 0, cached, evictable))
    return dict(
        running=running,
        queue=queue,
        free_pages=draw(st.integers(0, 60)),
        page_size=page_size,
        max_num_seqs=draw(st.integers(1, 10)),
        chunk_budget=draw(st.integers(1, 256)),
    )


@settings(max_examples=400, deadline=None)
@given(states())
def test_random_states_plan_within_pages_budget_and_seat_limits(state: dict) -> None:
    running: list[SeqView] = state["running"]
    queue: list[SeqView] = state["queue"]
    ps: int = state["page_size"]
    p = plan_step(running, queue, state["free_pages"], ps, state["max_num_seqs"], state["chunk_budget"])
    by_id = {s.seq_id: s for s in running + queue}

    scheduled = p.decode + [sid for sid, _ in p.extend]
    assert len(scheduled) == len(set(scheduled)), "a sequence is scheduled twice"
    assert not set(scheduled) & set(p.preempt), "a preempted sequence is scheduled"
    assert set(p.pages) == set(scheduled)

    # Pages: never more than free plus what preemption gives back, never negative, and
    # enough for the tokens each sequence computes this step.
    reclaimed = sum(by_id[sid].reclaimable_pages for sid in p.preempt)
    assert all(n >= 0 for n in p.pages.values())
    locked_by_admission = sum(by_id[sid].cached_evictable_pages for sid in p.admit)
    assert sum(p.pages.values()) + locked_by_admission <= state["free_pages"] + reclaimed
    for sid in p.decode:
        s = by_id[sid]
        assert s.num_computed == s.num_tokens - 1
        assert s.num_pages + p.pages[sid] >= pages_for(s.num_computed + 1, ps)
    for sid, n in p.extend:
        s = by_id[sid]
        start = s.cached_len if sid in p.admit else s.num_computed
        assert 1 <= n <= s.num_tokens - start
        held = pages_for(start, ps) if sid in p.admit else s.num_pages
        assert held + p.pages[sid] >= pages_for(start + n, ps)

    # Budgets and seats.
    assert sum(n for _, n in p.extend) <= state["chunk_budget"]
    now_running = len(running) - len(p.preempt)
    assert now_running + len(p.admit) <= max(state["max_num_seqs"], now_running)

    # Order: admissions are a prefix of the queue, preemptions the newest running, newest first.
    assert p.admit == [s.seq_id for s in queue[: len(p.admit)]]
    assert p.preempt == [s.seq_id for s in reversed(running)][: len(p.preempt)]
    assert set(p.admit) <= {sid for sid, _ in p.extend}
    if p.preempt:
        assert p.admit == []

    # Liveness: decodes that fit in the free pages all run, and nobody is preempted for nothing.
    decodes = [s for s in running if s.num_computed == s.num_tokens - 1]
    need = sum(pages_for(s.num_computed + 1, ps) - s.num_pages for s in decodes)
    if need <= state["free_pages"]:
        assert p.preempt == []
        assert p.decode == [s.seq_id for s in decodes]
