"""Which requests run in the next step: a pure function over small views of the state.

One step runs a mixed batch: every running sequence that is decoding gets one token (plus,
with speculative decoding, KV slots for its draft tokens), and a
budget of prompt tokens (`chunked_prefill_size`) goes first to sequences part-way through
their prompt, then to waiting requests in arrival order. A long prompt is cut into chunks,
so running decodes never wait for a whole prefill. When the pool cannot hold the decodes'
next tokens, the most recently admitted sequences are preempted (their pages freed; they
recompute later) rather than failing the step.

Requests that arrive together often share a prefix nobody has computed yet (a burst of
conversations on one system prompt, right after a start). Admitting them all in one step
would compute that prefix once per request. A waiting request whose next uncached tokens
another sequence is computing in this step waits one step instead, and then finds them in
the prefix cache (SGLang does the same: "in-batch prefix caching").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Two sequences whose next this-many uncached tokens are equal (at the same position) would
# compute at least that much KV twice; below it, deferring costs more than it saves.
SHARED_PREFIX_CHECK_TOKENS = 32


@dataclass(frozen=True)
class SeqView:
    """What the planner needs to know about one sequence."""

    seq_id: str
    num_tokens: int  # prompt + output so far
    num_computed: int  # tokens whose KV is in the pool
    num_pages: int  # pages it holds
    reclaimable_pages: int = 0  # pages that preempting it would give back
    cached_len: int = 0  # waiting only: prompt tokens the prefix cache would serve
    # waiting only: pages of that cached prefix now evictable (so counted in free_pages);
    # admitting locks them, so they stop being free.
    cached_evictable_pages: int = 0
    # The prompt tokens this sequence computes next (see next_tokens_key); None when fewer
    # than SHARED_PREFIX_CHECK_TOKENS prompt tokens are left to compute.
    next_tokens_key: int | None = None
    # decoding only: draft tokens proposed for this step (speculative decoding); they need
    # KV slots (pages) like the token itself.
    num_draft: int = 0


@dataclass
class StepPlan:
    decode: list[str] = field(default_factory=list)
    extend: list[tuple[str, int]] = field(default_factory=list)  # (seq id, new tokens)
    admit: list[str] = field(default_factory=list)  # the extend entries that start now
    preempt: list[str] = field(default_factory=list)
    pages: dict[str, int] = field(default_factory=dict)  # pages each scheduled seq must get
    deferred: list[str] = field(default_factory=list)  # waiting: another computes their prefix
    drafts: dict[str, int] = field(default_factory=dict)  # decodes: draft tokens granted pages

    @property
    def empty(self) -> bool:
        return not self.decode and not self.extend

    def rebase_admission(self, seq_id: str, num_tokens: int, num_computed: int, num_pages: int, page_size: int) -> int:
        """An admission whose cached prefix grew while it was admitted (pages brought back
        from L2/L3) starts later than planned: it computes the same chunk from there, or
        the rest of its prompt when that is shorter, and gets the pages for that instead.
        Returns its new token count."""
        i = next(i for i, (sid, _) in enumerate(self.extend) if sid == seq_id)
        n = min(self.extend[i][1], num_tokens - num_computed)
        self.extend[i] = (seq_id, n)
        self.pages[seq_id] = pages_for(num_computed + n, page_size) - num_pages
        return n


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def next_tokens_key(token_ids: Sequence[int], start: int, prompt_len: int) -> int | None:
    """Identifies the prompt tokens a sequence computes next from `start`: equal keys mean
    equal tokens at equal positions, hence equal KV."""
    end = start + SHARED_PREFIX_CHECK_TOKENS
    if end > prompt_len:
        return None
    return hash((start, tuple(token_ids[start:end])))


def _decode_pages(decoding: list[SeqView], page_size: int, with_drafts: bool) -> dict[str, int]:
    return {
        s.seq_id: max(0, pages_for(s.num_computed + 1 + (s.num_draft if with_drafts else 0), page_size) - s.num_pages)
        for s in decoding
    }


def plan_step(
    running: list[SeqView],
    waiting: list[SeqView],
    free_pages: int,
    page_size: int,
    max_num_seqs: int,
    chunk_budget: int,
) -> StepPlan:
    """`running` in admission order (oldest first), `waiting` in arrival order.
    `free_pages` counts free plus evictable cache pages."""
    plan = StepPlan()
    decoding = [s for s in running if s.num_computed == s.num_tokens - 1]
    prefilling = [s for s in running if s.num_computed < s.num_tokens - 1]

    # Decodes first: each needs a page when its next token (or a draft token) starts a new one.
    # Drafts only speed decoding up: when the pool cannot hold them all, none are verified
    # this step rather than preempting anyone for them.
    need = _decode_pages(decoding, page_size, with_drafts=True)
    drafting = sum(need.values()) <= free_pages
    if not drafting:
        need = _decode_pages(decoding, page_size, with_drafts=False)
    kept = list(running)
    while sum(need[s.seq_id] for s in kept if s.seq_id in need) > free_pages and len(kept) > 1:
        victim = kept.pop()  # newest admitted goes first: it has the least work to redo
        plan.preempt.append(victim.seq_id)
        free_pages += victim.reclaimable_pages
        need.pop(victim.seq_id, None)
    for s in decoding:
        if s.seq_id in need:
            plan.decode.append(s.seq_id)
            plan.pages[s.seq_id] = need[s.seq_id]
            free_pages -= need[s.seq_id]
            if drafting and s.num_draft:
                plan.drafts[s.seq_id] = s.num_draft
    if plan.preempt:
        # A step that had to preempt admits nothing: the pool is under pressure.
        kept_ids = {s.seq_id for s in kept}
        prefilling = [s for s in prefilling if s.seq_id in kept_ids]
        waiting = []
    if free_pages < 0:  # one sequence alone exceeds the pool: nothing can run it
        plan.decode.clear()
        plan.pages.clear()
        plan.drafts.clear()
        return plan

    budget = chunk_budget
    # Prompt tokens some sequence computes this step (or is part-way through computing).
    claimed = {s.next_tokens_key for s in prefilling if s.next_tokens_key is not None}
    for s in prefilling:
        if budget <= 0:
            break
        if s.seq_id in plan.preempt:
            continue
        n = min(s.num_tokens - s.num_computed, budget)
        pages = pages_for(s.num_computed + n, page_size) - s.num_pages
        if pages > free_pages:
            n = (s.num_pages + free_pages) * page_size - s.num_computed
            if n <= 0:
                continue
            pages = free_pages
        plan.extend.append((s.seq_id, n))
        plan.pages[s.seq_id] = pages
        free_pages -= pages
        budget -= n

    active = len(running) - len(plan.preempt)
    for s in waiting:
        if budget <= 0 or active >= max_num_seqs:
            break
        if s.next_tokens_key is not None and s.next_tokens_key in claimed:
            plan.deferred.append(s.seq_id)  # next step its prefix is cached
            continue
        start = s.cached_len
        n = min(s.num_tokens - start, budget)
        pages = pages_for(start + n, page_size) - pages_for(start, page_size)
        # Leave a page per decoding sequence so admitting does not force a preemption next step.
        if pages + s.cached_evictable_pages + len(plan.decode) > free_pages:
            break  # first come, first served: later arrivals do not jump the queue
        plan.extend.append((s.seq_id, n))
        plan.admit.append(s.seq_id)
        plan.pages[s.seq_id] = pages
        free_pages -= pages + s.cached_evictable_pages
        budget -= n
        active += 1
        if s.next_tokens_key is not None:
            claimed.add(s.next_tokens_key)
    return plan
