"""The scheduler: the waiting and running queues, and every move a sequence makes between them.

Each step it asks the pure planner (engine/sched/plan.py) what runs, over small views of
the queues, and carries the plan out: preemptions, admissions from the prefix cache and the
pages the plan granted, through the KV cache manager (engine/kv/cache_manager.py). After
the forward pass it records progress, appends the sampled tokens, checks the stop
conditions and finishes what is done (`postprocess`). It owns the request counters the
engine's stats report.

A request can fail, the engine cannot: an exception while admitting, caching, sampling or
detokenizing one sequence ends that sequence with finish_reason "error" (`fail`: its pages
freed) and the others go on. Everything here runs on the stepping thread.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import dataclass, field

from preheat.engine.kv.cache_manager import KVCacheManager
from preheat.engine.request.errors import QueueFull, RequestRejected
from preheat.engine.request.sequence import RequestOutput, Sequence, Status, TokenLogprob
from preheat.engine.runner import BatchEntry, EntryTokens
from preheat.engine.sched.plan import SeqView, StepPlan, next_tokens_key, plan_step

log = logging.getLogger(__name__)

QUEUE_RETRY_AFTER_S = 1.0  # what a 429 for a full queue tells the client to wait


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int  # running at once (--max-num-seqs)
    chunked_prefill_size: int  # prompt tokens per step
    max_queue_len: int  # sequences waiting to start (--max-queue-len)


@dataclass
class Batch:
    """One step's work: sequences decoding one token, and extends (prompt chunks, drafts to
    verify) of several."""

    decode: list[BatchEntry] = field(default_factory=list)
    extend: list[BatchEntry] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.extend

    def drop(self, entry: BatchEntry) -> None:
        (self.decode if entry in self.decode else self.extend).remove(entry)


@dataclass
class Counters:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    deferred: int = 0  # admissions put off a step for a sharer computing their prefix
    failed: int = 0  # requests ended by an error of their own
    spec_draft_tokens: int = 0  # speculative draft tokens verified by the model
    spec_accepted_tokens: int = 0  # of those, the ones it accepted


class Scheduler:
    def __init__(self, kv: KVCacheManager, page_size: int, limits: SchedulerLimits) -> None:
        self.kv = kv
        self.page_size = page_size
        self.limits = limits
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.counters = Counters()
        # The sequences the last plan looked at: the running ones and the head of the line.
        self._planned: dict[str, Sequence] = {}

    # --- the queues ---------------------------------------------------------------------------
    def check_room(self, seqs: int, handed_in: int) -> None:
        """Raises when `seqs` more sequences would make more than --max-queue-len wait
        (`handed_in`: those added but not yet taken by the stepping thread). Called from any
        thread, under the inbox's lock."""
        limit = self.limits.max_queue_len
        if seqs > limit:  # could never fit: waiting for room would not help
            raise RequestRejected(
                "request_too_large", "n",
                f"the request adds {seqs} sequences (prompts x n) but at most {limit} may wait "
                "(--max-queue-len); send fewer prompts or choices per request",
            )
        waiting = handed_in + len(self.waiting)
        if waiting + seqs > limit:
            raise QueueFull(
                "queue_full",
                f"the server is at capacity: {waiting} requests are waiting to start and at most "
                f"{limit} may (--max-queue-len); retry later",
                retry_after=QUEUE_RETRY_AFTER_S,
            )

    def add(self, seqs: list[Sequence]) -> None:
        self.waiting.extend(seqs)

    def abort(self, request_ids: set[str]) -> list[RequestOutput]:
        doomed = [s for s in itertools.chain(self.running, self.waiting) if s.request_id in request_ids]
        return [self.finish(seq, "abort") for seq in doomed]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admission_window(self) -> int:
        """How many waiting sequences the next plan looks at: as many as could start (free
        running slots), and as many again for those deferred to a sharer. The rest of the
        line costs the step nothing (no prefix match), however long it is."""
        free = max(0, self.limits.max_num_seqs - len(self.running))
        return 2 * free

    # --- schedule: plan, then apply -------------------------------------------------------------
    def schedule(self, drafts: dict[str, list[int]], outputs: list[RequestOutput]) -> Batch:
        """What runs this step: the pure planner decides over views of the queues, then the
        plan is carried out. `drafts`: this step's speculative proposals by request id."""
        plan = self.plan(drafts)
        return self._apply(plan, drafts, outputs)

    def plan(self, drafts: dict[str, list[int]] | None = None) -> StepPlan:
        running, waiting = self._views(drafts or {})
        limits = self.limits
        return plan_step(running, waiting, self.kv.free_pages, self.page_size, limits.max_num_seqs,
                         limits.chunked_prefill_size)

    def _views(self, drafts: dict[str, list[int]]) -> tuple[list[SeqView], list[SeqView]]:
        sharing = self.kv.radix is not None  # deferring to a sharer only pays with a prefix cache
        # A request waiting for its L3 pages is not in the head: the line moves past it.
        ready = (s for s in self.waiting if not self.kv.prefetch_pending(s))
        head = list(itertools.islice(ready, self.admission_window()))
        self._planned = {s.request_id: s for s in itertools.chain(self.running, head)}
        running = [
            SeqView(
                s.request_id, s.num_tokens, s.num_computed, len(s.pages), len(s.pages) - s.num_shared,
                next_tokens_key=(
                    next_tokens_key(s.all_token_ids, s.num_computed, s.num_tokens - 1)
                    if sharing and s.num_computed % self.page_size == 0
                    else None
                ),
                num_draft=len(drafts.get(s.request_id, ())),
            )
            for s in self.running
        ]
        waiting = []
        for s in head:
            if not sharing:
                waiting.append(SeqView(s.request_id, s.num_tokens, 0, 0, 0))
                continue
            tokens = s.all_token_ids
            cached = self.kv.peek_prefix(tokens[: s.max_cached_prefix + 1])
            waiting.append(
                SeqView(
                    s.request_id, s.num_tokens, 0, 0, 0, cached.length, cached.evictable_pages,
                    next_tokens_key(tokens, cached.length, len(tokens) - 1),
                )
            )
        return running, waiting

    def _apply(self, plan: StepPlan, drafts: dict[str, list[int]], outputs: list[RequestOutput]) -> Batch:
        """Carries the plan out: preemptions, admissions, and each scheduled sequence gets the
        pages the plan granted it. A sequence whose pages cannot be had after all (pinned
        or tier pages the planner could not foresee) does not run: a decode is preempted, an
        admission goes back in line, a continuing prefill waits a step. An admission that
        raises fails that request alone."""
        self.counters.deferred += len(plan.deferred)
        by_id = self._planned
        for rid in plan.preempt:
            self._preempt(by_id[rid])
        failed = self._admit_planned(plan, outputs)
        batch = Batch()
        drafted: list[BatchEntry] = []
        for rid in plan.decode:
            seq = by_id[rid]
            if not self.kv.grow(seq, plan.pages[rid]):
                self._preempt(seq)
                continue
            draft = drafts.get(rid, [])[: plan.drafts.get(rid, 0)]
            if draft:  # verified as an extend of 1 + len(draft) tokens over its prefix
                drafted.append(BatchEntry(seq, seq.num_computed, 1 + len(draft), True, draft))
            else:
                batch.decode.append(BatchEntry(seq, seq.num_computed, 1, True))
        batch.extend.extend(drafted)
        for rid, n in plan.extend:
            if rid in failed:
                continue
            seq = by_id[rid]
            if not self.kv.grow(seq, plan.pages[rid]):
                if rid in plan.admit:
                    self._requeue(seq)
                continue
            last = seq.num_computed + n == seq.num_tokens
            batch.extend.append(BatchEntry(seq, seq.num_computed, n, last and not seq.params.prompt_only))
        return batch

    def _admit_planned(self, plan: StepPlan, outputs: list[RequestOutput]) -> set[str]:
        """Moves the plan's admissions from the line to running; returns those that failed."""
        failed: set[str] = set()
        for rid in plan.admit:
            seq = self._planned[rid]
            self.waiting.remove(seq)
            self.running.append(seq)
            try:
                if self._admit(seq):  # pages came back from L2/L3: it starts later than planned
                    plan.rebase_admission(rid, seq.num_tokens, seq.num_computed, len(seq.pages), self.page_size)
            except Exception as exc:
                outputs.append(self.fail(seq, "admitting it", exc))
                failed.add(rid)
        return failed

    def _admit(self, seq: Sequence) -> int:
        """Moves a waiting sequence to running from its cached prefix; returns the tokens
        brought back from L2/L3 (see KVCacheManager.admit)."""
        seq.status = Status.RUNNING  # first: a failing admission is released like a running one
        restored = self.kv.admit(seq)
        if seq.cached_tokens is None:
            seq.cached_tokens = seq.num_computed
            self.counters.prompt_tokens += len(seq.prompt_token_ids)
            self.counters.cached_tokens += seq.num_computed
        return restored

    def _requeue(self, seq: Sequence) -> None:
        """Back to the head of the line, its pages given back (what it computed stays cached)."""
        self.kv.release(seq)
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        self.counters.preemptions += 1

    # --- postprocess: progress, tokens, stop checks ----------------------------------------------
    def postprocess(self, batch: Batch, results: list[EntryTokens]) -> list[RequestOutput]:
        """Records what the forward pass computed and sampled; returns the outputs."""
        outputs = self._record_progress(batch)
        for r in results:
            if r.seq.finished:
                continue  # failed above
            if r.error is not None:
                outputs.append(self.fail(r.seq, "verifying its draft" if r.num_draft else "sampling", r.error))
                continue
            outputs.append(self._take_tokens(r))
        return outputs

    def _record_progress(self, batch: Batch) -> list[RequestOutput]:
        outputs = []
        for entry in batch.decode:
            entry.seq.num_computed += 1
        for entry in batch.extend:
            if entry.draft:
                continue  # its progress depends on how much of the draft was accepted
            entry.seq.num_computed += entry.length
            try:
                self.kv.cache_progress(entry.seq)  # concurrent requests can share a prefix at once
            except Exception as exc:
                outputs.append(self.fail(entry.seq, "caching its prefix", exc))
                continue
            if entry.seq.params.prompt_only and entry.seq.num_computed == entry.seq.num_tokens:
                outputs.append(self.finish(entry.seq, "length"))  # computed and cached: done
        return outputs

    def _take_tokens(self, r: EntryTokens) -> RequestOutput:
        seq = r.seq
        try:
            if r.num_draft:
                # The last known token and the accepted drafts now have verified KV; the
                # rejected drafts' KV is dead: pages holding only that go back to the pool.
                seq.num_computed += len(r.token_ids)
                self.counters.spec_draft_tokens += r.num_draft
                self.counters.spec_accepted_tokens += len(r.token_ids) - 1
            lps: list[TokenLogprob | None] = [None] * len(r.token_ids)
            if seq.logprobs is not None and r.logprobs is not None:
                tops = r.top_logprobs or [[] for _ in r.token_ids]
                lps = [TokenLogprob(t, lp, top) for t, lp, top in zip(r.token_ids, r.logprobs, tops)]
            output = self._append_tokens(seq, r.token_ids, lps)
            if r.num_draft and seq.status is Status.RUNNING:
                self.kv.truncate(seq, seq.num_tokens)
            return output
        except Exception as exc:  # the grammar matcher, the detokenizer, stop strings
            # A draft step counted its accepted tokens as computed before appending them:
            # only those appended may be cached when its pages are released.
            seq.num_computed = min(seq.num_computed, seq.num_tokens)
            return self.fail(seq, "detokenizing", exc)

    def _append_tokens(self, seq: Sequence, tokens: list[int], lps: list[TokenLogprob | None]) -> RequestOutput:
        """Appends this step's tokens one by one, as decoding them one per step would: the
        first that finishes the request (stop token or string, grammar end, length) is the
        last; the rest are dropped."""
        for token, lp in zip(tokens, lps):
            reason = self._append_token(seq, token, lp)
            if reason is not None:
                # Draft tokens past this one were computed but are not part of the output.
                seq.num_computed = min(seq.num_computed, seq.num_tokens)
                return self.finish(seq, reason)
        return seq.take_output()

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> str | None:
        """Appends one token; returns the finish reason it causes, if any."""
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.output_token_ids.append(token)
        self.counters.generation_tokens += 1
        if lp is not None and seq.logprobs is not None:
            seq.logprobs.append(lp)
        reason = None
        if seq.matcher is not None:
            accepted = seq.matcher.accept_token(token)
            if not accepted or seq.matcher.is_terminated():
                reason = "stop"
        if token in seq.stop_token_ids:
            reason = "stop"
        else:
            seq.detokenizer.add(token)
            if seq.detokenizer.stopped:
                reason = "stop"
        if reason is None and seq.num_tokens >= seq.max_total_tokens:
            reason = "length"
        return reason

    # --- leaving ----------------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str) -> RequestOutput:
        self._remove(seq)
        seq.finish_reason = reason
        try:
            return seq.take_output()
        except Exception as exc:  # its detokenizer: the request fails, the step goes on
            return self.fail(seq, "detokenizing", exc)

    def _remove(self, seq: Sequence) -> None:
        """Takes a sequence out of the running set or the line, its pages given back. Marked
        finished first, so a second call (after a failing release) does nothing."""
        status, seq.status = seq.status, Status.FINISHED
        if status is Status.RUNNING:
            self.running.remove(seq)
            self.kv.release(seq)
        elif status is Status.WAITING:
            self.waiting.remove(seq)

    def fail(self, seq: Sequence, stage: str, exc: BaseException) -> RequestOutput:
        """Ends one request that raised while the engine was `stage`: logged with its id, its
        pages freed, and an output with finish_reason "error" that names the failure (the
        server answers 500). Its detokenizer is not asked again: it may be what failed."""
        log.error("request %s failed while %s: %s: %s", seq.request_id, stage, type(exc).__name__, exc,
                  exc_info=(type(exc), exc, exc.__traceback__))
        self.counters.failed += 1
        try:
            self._remove(seq)
        except Exception:  # what it held cannot be given back cleanly; the others go on
            log.exception("request %s: releasing its KV pages failed", seq.request_id)
        return seq.error_output(f"the request failed while {stage}: {type(exc).__name__}: {exc}")

    def fail_unrunnable(self, outputs: list[RequestOutput]) -> None:
        """Nothing could be scheduled. If sequences are running, the pool is held by what
        cannot be evicted (pinned prefixes): the newest running sequence ends with "length",
        as far as memory let it go. If nothing fits even in an empty pool, the head request
        fails. Either way the engine never spins without progress."""
        if not self.running and self.kv.wait_prefetch(self.waiting, 0.01):
            return  # only requests waiting for L3 pages: let the disk work
        if self.running:
            log.warning("kv pool exhausted by pinned or locked prefixes; ending the newest request")
            outputs.append(self.finish(self.running[-1], "length"))
            return
        if self.waiting and self.kv.all_free():
            outputs.append(self.finish(self.waiting[0], "abort"))
