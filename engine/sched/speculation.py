"""Speculative decoding's drafting side: which decoding sequences get a draft this step, and
the warm-up of the verify path before the engine serves.

The drafter (prompt lookup, engine/sample/spec_decode.py) proposes; the planner grants the
drafts KV pages; the runner verifies them as extends and the sampler accepts a prefix
(engine/sample/sampler.py). A draft only ever speeds a request up, so anything that goes
wrong here costs that sequence its draft for one step, never the request.

With `--speculative-gate auto` (the default) a draft is verified only where it is expected
to pay (engine/sched/spec_policy.py): from each sequence's recent acceptance and the
measured cost of a draft token at this batch size (engine/sched/spec_stats.py). Every
decoding sequence's draft is looked up first (a few dict reads on its n-gram index) and
only the drafts found are planned, each priced at its own length. Where a draft does not
pay the sequence decodes plainly and, every few steps, its draft is remembered without
being verified (a shadow draft), so its acceptance stays known and drafting resumes when
its text starts repeating. A plan is verified only if its predicted speedup, scaled by what
drafted steps near this batch size actually gave against their predictions
(spec_stats.DraftOutcomes), still beats decoding plainly. `always` drafts on every n-gram
match, as before the gate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from preheat.engine.config import SpeculativeSettings
from preheat.engine.kv.cache_manager import KVCacheManager
from preheat.engine.request.builder import RequestBuilder
from preheat.engine.request.sampling_params import SamplingParams
from preheat.engine.request.sequence import Sequence
from preheat.engine.runner import BatchEntry, ModelRunner
from preheat.engine.sample.spec_decode import NgramDrafter, NgramIndex, draft_limit
from preheat.engine.sched.spec_policy import expected_speedup, plan_draft_lengths
from preheat.engine.sched.spec_stats import AcceptanceProfile, DraftOutcomes, StepCosts, resolve

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateSettings:
    """The gate's constants. Priors are what it assumes before it has measured anything:
    a draft token right half the time; a draft token and a drafted sequence each costing
    up to half a decoded token, a quarter at batch 8, little at batch 1 (spec_policy.
    prior_cost) — enough to try drafting at once, so all are soon measured."""

    prior_acceptance: float = 0.5
    prior_draft_cost: float = 0.5
    prior_sequence_cost: float = 0.5
    prior_half_batch: int = 8
    prior_weight: float = 1.0  # pseudo-observations a sequence's estimate starts from
    sequence_decay: float = 0.8  # a sequence's recent drafts count most
    global_decay: float = 0.98  # across sequences: the prior of a new one
    shadow_every: int = 4  # steps between shadow drafts scored for a sequence kept from drafting
    # A plan is verified only when its predicted speedup, scaled by what drafted steps gave
    # against their predictions (DraftOutcomes), passes this: a drafted step's outcome
    # scatters widely around its prediction (0.5-1.5x at batch 16), so a plan predicted to
    # gain a percent or two gains nothing on average and is a slower step half the time.
    # Same process, 8 rounds each (Zen 4 host), 1.03 against 1.0: the GGUF default on edits
    # 0.991x vs 0.975x of off at batch 16, 0.997x vs 0.969x at 8, rag at 8 0.985x vs 0.987x;
    # bf16 edits at 8 1.096x vs 1.077x, rag at 16 0.984x vs 0.986x.
    min_step_speedup: float = 1.03


@dataclass
class _SeqState:
    profile: AcceptanceProfile
    pending: tuple[int, list[int]] | None = None  # (position of its first token, draft)
    shadow_in: int = 0


@dataclass
class _Plan:
    """What the gate expected of this step's drafts, kept until the step is timed."""

    gains: dict[str, list[float]]  # of the sequences it let draft, by request id
    draft_cost: float
    sequence_cost: float


class Speculator:
    def __init__(self, config: SpeculativeSettings, gate: GateSettings | None = None) -> None:
        self.enabled = config.speculative_method is not None
        self.num_speculative_tokens = config.num_speculative_tokens
        self.drafter = NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
        self.gated = config.speculative_gate == "auto"
        self.gate = gate or GateSettings()
        self.costs = StepCosts(self.gate.prior_draft_cost, self.gate.prior_sequence_cost, self.gate.prior_half_batch)
        self.acceptance = AcceptanceProfile(self.num_speculative_tokens, self.gate.global_decay)
        self.outcomes = DraftOutcomes()
        self._plan: _Plan | None = None
        self._seqs: dict[str, _SeqState] = {}
        self._indexes: dict[str, NgramIndex] = {}  # per decoding sequence, where the drafter keeps them
        self.warmup_seconds = 0.0
        if self.enabled:
            log.info(
                "speculative decoding: %s, up to %d draft tokens, n-grams of %d..%d tokens, gate %s",
                config.speculative_method, config.num_speculative_tokens,
                config.prompt_lookup_min, config.prompt_lookup_max, "auto" if self.gated else "always",
            )

    def propose(self, running: Iterable[Sequence]) -> dict[str, list[int]]:
        """A prompt-lookup draft for each decoding sequence it is expected to pay for (none
        for a sequence with no n-gram match or no room left before its length limit, none
        at all when speculation is off). When proposing one raises, that sequence decodes
        without one this step (logged), and nothing else is affected."""
        if not self.enabled:
            return {}
        running = list(running)
        decoding = [s for s in running if s.num_computed == s.num_tokens - 1]  # the rest prefill
        self._forget_left(running)
        limits = [draft_limit(self.num_speculative_tokens, s.num_tokens, s.max_total_tokens) for s in decoding]
        if not self.gated:
            return self._lookup(decoding, limits)
        self._track(decoding)
        self._plan = None
        if not decoding or self.costs.wants_plain(len(decoding)):
            for seq, limit in zip(decoding, limits):
                self._shadow(seq, limit, None)
            return {}
        # Looked up before planning: where nothing matches there is nothing to plan (on text
        # that does not repeat, planning a draft no lookup found was most of the gate's own
        # time), and a plan priced on the draft each sequence has is priced on what it can
        # verify, not on a full-length draft it may not have.
        found = self._lookup(decoding, limits)
        lengths = self._lengths(decoding, found) if found else [0] * len(decoding)
        drafts = {}
        for seq, n, limit in zip(decoding, lengths, limits):
            draft = found.get(seq.request_id)
            if n and draft:
                drafts[seq.request_id] = draft[:n]
                self._remember(seq, draft[:n])
            else:
                self._shadow(seq, limit, draft or [])
        return drafts

    def _lengths(self, decoding: list[Sequence], found: dict[str, list[int]]) -> list[int]:
        """The gate: draft tokens each decoding sequence may verify this step, of the drafts
        its lookup `found` (none for a sequence without one)."""
        batch = len(decoding)
        g = self.gate
        prior = self.acceptance.gains(self.num_speculative_tokens, [g.prior_acceptance] * self.num_speculative_tokens,
                                      g.prior_weight)
        gains = [self._seqs[s.request_id].profile.gains(len(found.get(s.request_id, ())), prior, g.prior_weight)
                 for s in decoding]
        kappa, sigma = self.costs.costs(batch)
        lengths = plan_draft_lengths(gains, batch, kappa, sigma)
        if any(lengths) and (self.outcomes.discount(batch) * expected_speedup(gains, lengths, batch, kappa, sigma)
                             <= g.min_step_speedup):
            lengths = [0] * batch  # drafted steps here gave less than predicted: this one would not pay
        if not any(lengths) and self.costs.wants_draft_probe(batch):
            # Drafts kept out for a while: were they kept out by their cost alone (they would
            # pay at the prior's cost)? Then draft once to measure that cost again (load
            # changes; it may have been measured in a bad moment).
            prior_kappa, prior_sigma = self.costs.prior(batch)
            lengths = plan_draft_lengths(gains, batch, min(kappa, prior_kappa), min(sigma, prior_sigma))
        if any(lengths):
            self._plan = _Plan({s.request_id: g for s, g, n in zip(decoding, gains, lengths) if n}, kappa, sigma)
        return lengths

    def _lookup(self, decoding: list[Sequence], lengths: list[int]) -> dict[str, list[int]]:
        """Drafts of up to `lengths` tokens, by request id (none where nothing matches)."""
        drafts = {}
        for seq, n in zip(decoding, lengths):
            try:
                if n and (draft := self._draft(seq, n)):
                    drafts[seq.request_id] = draft
            except Exception:
                log.exception("request %s: proposing a draft failed; it decodes without one", seq.request_id)
        return drafts

    def _shadow(self, seq: Sequence, limit: int, found: list[int] | None) -> None:
        """Every few steps, a draft remembered but not verified: `found` where this step's
        lookup gave it (None: look it up)."""
        if not limit:
            return
        state = self._seqs[seq.request_id]
        if state.shadow_in > 0:
            state.shadow_in -= 1
            return
        if state.pending is not None:
            return  # the last one is still being scored
        state.shadow_in = self.gate.shadow_every - 1
        try:
            self._remember(seq, self._draft(seq, limit) if found is None else found)
        except Exception:
            log.exception("request %s: looking up a shadow draft failed", seq.request_id)

    def _draft(self, seq: Sequence, n: int) -> list[int]:
        """Up to n draft tokens for `seq`: from its index (brought up to date with the tokens
        it gained) where the drafter keeps one, else from its whole context."""
        make = getattr(self.drafter, "index", None)
        if make is None:
            return self.drafter.propose(seq.all_token_ids, n)[:n]
        index = self._indexes.get(seq.request_id)
        if index is None or index.length > seq.num_tokens:
            index = self._indexes[seq.request_id] = make()
        if index.length < seq.num_tokens:
            index.extend(seq.token_ids(index.length, seq.num_tokens))
        return index.propose(n)[:n]

    def _remember(self, seq: Sequence, draft: list[int]) -> None:
        state = self._seqs[seq.request_id]
        if state.pending is not None:  # a shadow overtaken by a real draft: what is known of it
            self._observe(state, *resolve(state.pending[1], _since(seq, *state.pending))[:2])
        state.pending = (seq.num_tokens, draft) if draft else None

    def _forget_left(self, running: list[Sequence]) -> None:
        """Drops the per-sequence state (acceptance, n-gram index) of sequences that left."""
        if not (self._seqs or self._indexes):
            return
        live = {s.request_id for s in running}
        for by_id in (self._seqs, self._indexes):
            for rid in [r for r in by_id if r not in live]:
                del by_id[rid]

    def _track(self, decoding: list[Sequence]) -> None:
        """Scores the drafts whose tokens have arrived; starts tracking new sequences."""
        for seq in decoding:
            state = self._seqs.get(seq.request_id)
            if state is None:
                self._seqs[seq.request_id] = _SeqState(
                    AcceptanceProfile(self.num_speculative_tokens, self.gate.sequence_decay))
                continue
            if state.pending is None:
                continue
            known, accepted, final = resolve(state.pending[1], _since(seq, *state.pending))
            if final:
                self._observe(state, known, accepted)
                state.pending = None

    def _observe(self, state: _SeqState, known: int, accepted: int) -> None:
        state.profile.observe(known, accepted)
        self.acceptance.observe(known, accepted)

    def observe_step(self, decode: list[BatchEntry], extend: list[BatchEntry], seconds: float,
                     tokens: int | None = None) -> None:
        """Times a step for the gate: steps that ran only decodes and drafts (a prompt chunk
        would make the time say nothing about either). `tokens`: what the step yielded (each
        sequence's token plus its accepted draft tokens), to set a drafted step's outcome
        against the gate's prediction (DraftOutcomes)."""
        plan, self._plan = self._plan, None
        if not (self.enabled and self.gated) or any(not e.draft for e in extend):
            return
        batch = len(decode) + len(extend)
        self.costs.observe(batch, len(extend), sum(len(e.draft or ()) for e in extend), seconds)
        if plan is None or not extend or tokens is None or seconds <= 0:
            return
        plain = self.costs.plain_seconds(batch)
        if plain is None:
            return
        try:
            gains = [plan.gains[e.seq.request_id] for e in extend]
        except KeyError:
            return  # a draft the plan did not make (the step is not the one planned)
        predicted = expected_speedup(gains, [len(e.draft or ()) for e in extend], batch, plan.draft_cost,
                                     plan.sequence_cost)
        self.outcomes.observe(batch, predicted, tokens * plain / (batch * seconds))


def _since(seq: Sequence, start: int, draft: list[int]) -> list[int]:
    """The tokens `seq` has at a draft's positions so far (not its whole context: copying
    that for each sequence a step cost the gate ~5 us a sequence at ~600 tokens)."""
    return seq.token_ids(start, min(seq.num_tokens, start + len(draft)))


def warm_speculation(
    runner: ModelRunner, kv: KVCacheManager, requests: RequestBuilder, num_speculative_tokens: int,
    max_num_seqs: int, vocab_size: int, max_model_len: int, page_size: int,
) -> float:
    """Runs the speculative path at batch sizes 1, 2 and 4 (up to --max-num-seqs) before
    the engine serves: a short prefill, then a verify step with a full draft through the
    extend path, every row's logits and the verify sampler (greedy and sampled rows). The
    first drafted steps after /ready then cost what steady ones do (on CPU oneDNN builds
    a kernel per matmul shape the first time it sees it; on GPU the eager extend path
    picks its kernels). Bigger batches are left to traffic and warmup templates: each
    size here is a real forward pass of start-up time. Uses pages of its own and leaves
    the radix cache and the counters alone. Returns the seconds it took."""
    started = time.monotonic()
    k = num_speculative_tokens
    prompt = [(11 + 7 * i) % vocab_size for i in range(max(8, k + 1))]  # short: the verify step is what counts
    if len(prompt) + k + 1 > max_model_len:
        return 0.0
    for bs in (1, 2, 4):
        if bs > max_num_seqs:
            break
        seqs: list[Sequence] = []
        try:
            for i in range(bs):
                params = SamplingParams(max_tokens=k + 2, temperature=0.0 if i % 2 else 1.0, ignore_eos=True)
                pages = kv.alloc(-(-(len(prompt) + k + 1) // page_size))
                if pages is None:
                    break
                seq = requests.build(prompt, params, f"spec-warmup-{bs}-{i}")
                seq.pages = pages
                seqs.append(seq)
            if len(seqs) < bs:
                break
            runner.run([], [BatchEntry(s, 0, len(prompt) - 1, False) for s in seqs])
            verified = runner.run([], [BatchEntry(s, len(prompt) - 1, 1 + k, True, prompt[:k]) for s in seqs])
            for r in verified:  # the runner contains a row's failure; start-up must not
                if r.error is not None:
                    raise r.error
        finally:
            for s in seqs:
                kv.pool.free(s.pages)
                s.pages = []
    took = time.monotonic() - started
    log.info("speculative decoding warmed up in %.2fs", took)
    return took
