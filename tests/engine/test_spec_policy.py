"""Speculation's gate without a model: the pure decision (how many draft tokens each sequence
verifies, from acceptance, batch size and the measured cost of a draft token), the estimates
it decides from (acceptance scored against the token stream, step costs), and the
Speculator using them over stand-in sequences and drafters."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import pytest

from preheat.engine.config import EngineConfig
from preheat.engine.runner import BatchEntry
from preheat.engine.sample.spec_decode import propose_ngram
from preheat.engine.sched.spec_policy import draft_cost, expected_speedup, plan_draft_lengths, prior_cost
from preheat.engine.sched.spec_stats import AcceptanceProfile, DraftOutcomes, StepCosts, fit_costs, resolve
from preheat.engine.sched.speculation import Speculator

# --- the decision -------------------------------------------------------------------------------


def test_batch_one_drafts_in_full_when_a_draft_token_is_cheap() -> None:
    assert plan_draft_lengths([[0.9, 0.8, 0.7, 0.6]], batch_size=1, draft_cost=0.06) == [4]


def test_a_large_batch_steps_aside_for_drafts_that_are_seldom_right() -> None:
    gains = [[0.3, 0.2, 0.1, 0.05]] * 16
    assert plan_draft_lengths(gains, batch_size=16, draft_cost=0.5) == [0] * 16


def test_the_same_acceptance_pays_at_batch_one_and_not_at_sixteen() -> None:
    # kappa grows with the batch: the measured cost of a row against a step's share per token
    gains = [0.45, 0.3, 0.2, 0.15]
    assert plan_draft_lengths([gains], 1, draft_cost=0.06)[0] == 4
    assert plan_draft_lengths([gains] * 16, 16, draft_cost=0.5) == [0] * 16


def test_only_the_sequences_whose_drafts_are_right_draft() -> None:
    gains = [[0.95, 0.9, 0.85, 0.8], [0.1, 0.01, 0.0, 0.0]] + [[0.2, 0.1, 0.05, 0.0]] * 6
    lengths = plan_draft_lengths(gains, batch_size=8, draft_cost=0.25)
    assert lengths[0] == 4 and lengths[1:] == [0] * 7


def test_a_draft_is_cut_where_its_tokens_stop_paying() -> None:
    lengths = plan_draft_lengths([[0.9, 0.6, 0.3, 0.1]], batch_size=8, draft_cost=0.4)
    assert lengths == [2]  # 0.9 and 0.6 clear ~0.44 (with the margin); 0.3 does not


def test_a_dear_drafted_sequence_needs_a_long_right_draft() -> None:
    # one right token does not pay for a sequence's extend; four do
    assert plan_draft_lengths([[0.9]], 8, draft_cost=0.1, sequence_cost=1.0) == [0]
    assert plan_draft_lengths([[0.9, 0.9, 0.9, 0.9]], 8, draft_cost=0.1, sequence_cost=1.0) == [4]
    # and once a sequence drafts, its further tokens pay their own row only
    assert plan_draft_lengths([[0.9, 0.5, 0.3, 0.15]], 8, 0.1, 1.0) == [4]


def test_no_batch_or_no_candidates_means_no_drafts() -> None:
    assert plan_draft_lengths([], 4, 0.1) == []
    assert plan_draft_lengths([[0.9]], 0, 0.1) == [0]
    assert plan_draft_lengths([[]], 1, 0.0) == [0]


def test_free_drafts_are_always_taken_and_worthless_ones_never() -> None:
    assert plan_draft_lengths([[0.01, 0.01]], 32, 0.0) == [2]
    assert plan_draft_lengths([[0.0, 0.0]], 1, 0.01) == [0]


@pytest.mark.parametrize("seed", range(60))
def test_the_lengths_are_the_best_of_every_choice_of_draft_prefixes(seed: int) -> None:
    rng = random.Random(seed)
    n, k = rng.randint(1, 4), rng.randint(1, 4)
    batch = n + rng.randint(0, 8)
    gains = []
    for _ in range(n):
        g, row = 1.0, []
        for _ in range(rng.randint(0, k)):
            g *= rng.random() ** 0.5
            row.append(g)
        gains.append(row)
    kappa, sigma, margin = rng.choice([0.0, 0.05, 0.2, 0.5, 1.0]), rng.choice([0.0, 0.1, 0.5, 1.5]), 0.1
    got = plan_draft_lengths(gains, batch, kappa, sigma, margin)
    priced = kappa * (1 + margin), sigma * (1 + margin)
    best = max(expected_speedup(gains, c, batch, *priced)
               for c in itertools.product(*[range(len(g) + 1) for g in gains]))
    assert expected_speedup(gains, got, batch, *priced) == pytest.approx(best, rel=1e-12)
    assert best > 1.0 or not any(got)  # drafts only when they beat decoding plainly
    assert all(0 <= m <= len(g) for m, g in zip(got, gains))


def test_draft_cost_is_a_row_in_decoded_tokens_worth() -> None:
    # 48 ms for 8 tokens = 6 ms a token; a draft token adds 1.5 ms = a quarter of one
    assert draft_cost(8, 0.048, 0.0015) == pytest.approx(0.25)
    assert draft_cost(8, 0.048, 0.003) == pytest.approx(0.5)  # a drafted sequence's 3 ms: sigma
    assert draft_cost(0, 0.048, 0.0015) == float("inf")


def test_the_prior_cost_rises_with_the_batch() -> None:
    assert prior_cost(1, 0.5, 8) == pytest.approx(0.5 / 9)
    assert prior_cost(8, 0.5, 8) == pytest.approx(0.25)
    assert prior_cost(64, 0.5, 8) < 0.5
    assert prior_cost(3, 0.5, 0) == 0.5
    c = StepCosts(0.5, 0.5, prior_half_batch=8)
    assert c.costs(1) == pytest.approx((0.5 / 9, 0.5 / 9)) and c.costs(8) == pytest.approx((0.25, 0.25))


# --- what it decides from ---------------------------------------------------------------------


def test_a_draft_is_scored_against_the_tokens_that_came() -> None:
    assert resolve([5, 6, 7], [5, 6, 9, 1]) == (3, 2, True)  # a mismatch seals it
    assert resolve([5, 6, 7], [5, 6, 7, 1]) == (3, 3, True)  # all kept
    assert resolve([5, 6, 7], [5, 6]) == (2, 2, False)  # so far so good
    assert resolve([5, 6, 7], [4]) == (3, 0, True)
    assert resolve([5, 6, 7], []) == (0, 0, False)


def test_the_acceptance_profile_learns_per_position_and_falls_with_it() -> None:
    p = AcceptanceProfile(4, decay=1.0)
    for _ in range(3):
        p.observe(4, 4)  # whole drafts kept
    p.observe(4, 1)  # then one kept after a single token
    assert p.gains(4, [0.5] * 4, prior_weight=0.0) == pytest.approx([1.0, 0.75, 0.75, 0.75])
    # pulled toward the prior with no observations; never rising with the position
    assert AcceptanceProfile(3, 0.9).gains(3, [0.5, 0.7, 0.2], prior_weight=2.0) == pytest.approx([0.5, 0.5, 0.2])
    assert p.gains(2, [0.5] * 4, 0.0) == pytest.approx([1.0, 0.75])  # only as many as asked


def test_old_observations_fade() -> None:
    p = AcceptanceProfile(1, decay=0.5)
    for _ in range(10):
        p.observe(1, 0)
    for _ in range(5):
        p.observe(1, 1)
    assert p.gains(1, [0.0], 0.0)[0] > 0.9


def test_step_costs_from_plain_and_drafted_steps() -> None:
    c = StepCosts(prior_draft_cost=0.25, prior_sequence_cost=0.5)
    assert c.costs(8) == (0.25, 0.5)  # nothing timed yet: the prior
    for _ in range(5):
        c.observe(8, 0, 0, 0.048)
    assert c.costs(8) == (0.25, 0.5)  # no drafted step yet
    # 6 ms a decoded token; a draft token adds 1.5 ms (kappa 0.25), a drafted sequence 3 ms (sigma 0.5)
    for d, k in [(8, 32), (8, 8), (2, 8), (4, 4), (1, 4), (8, 16)] * 4:
        c.observe(8, d, k, 0.048 + d * 0.003 + k * 0.0015)
    kappa, sigma = c.costs(8)
    assert kappa == pytest.approx(0.25, rel=0.02) and sigma == pytest.approx(0.5, rel=0.05)
    # another batch size: its own plain time; the seconds a draft costs carry over
    for _ in range(3):
        c.observe(16, 0, 0, 0.072)
    kappa, sigma = c.costs(16)
    assert kappa == pytest.approx(0.0015 * 16 / 0.072, rel=0.05)


def test_a_cost_per_sequence_is_not_mistaken_for_dear_tokens() -> None:
    c = StepCosts(0.25, 0.25)
    for _ in range(3):
        c.observe(16, 0, 0, 0.040)
    # drafts of one token: 4 ms each, almost all of it the sequence's extend, not the token
    for d, k in [(4, 4), (2, 2), (8, 8), (4, 16), (8, 32)] * 4:
        c.observe(16, d, k, 0.040 + d * 0.0035 + k * 0.0005)
    kappa, sigma = c.costs(16)
    # one cost per token would have said (3.5 d + 0.5 k) / k ms: 1.4 to 4 ms, kappa 0.6 to 1.6
    assert kappa == pytest.approx(0.0005 * 16 / 0.040, rel=0.3)
    assert sigma == pytest.approx(0.0035 * 16 / 0.040, rel=0.1)


def test_the_fit_keeps_the_prior_split_when_drafts_all_have_one_length() -> None:
    per_token, per_seq = fit_costs([(4, 16, 4 * 0.002 + 16 * 0.001)] * 10, 0.001, 0.002, 2)
    assert per_token == pytest.approx(0.001) and per_seq == pytest.approx(0.002)
    per_token, per_seq = fit_costs([(2, 2, -0.01)] * 5, 0.001, 0.001, 2)  # noise below zero
    assert per_token >= 0 and per_seq >= 0


def test_prices_follow_every_drafted_step_while_the_window_fills_and_lag_it_by_an_eighth_once_full() -> None:
    c = StepCosts(prior_draft_cost=0.25, prior_sequence_cost=0.5, window=32)
    for _ in range(3):
        c.observe(8, 0, 0, 0.048)
    rng = random.Random(3)
    windows: list[list[tuple[int, int, float]]] = []  # the window after each drafted step
    for i in range(48):
        d, k = rng.randint(1, 8), rng.randint(1, 32)
        c.observe(8, d, k, 0.048 + d * 0.003 * (1 + i / 16) + k * 0.0015)  # dearer and dearer
        windows.append(list(c.drafted))
        unit = 0.048 / 8
        prices = tuple(x * unit for x in c.costs(8))
        fits = [fit_costs(w, 0.25 * unit, 0.5 * unit, c.prior_samples) for w in windows[-4:]]
        fresh = fits[-1]
        if len(windows[-1]) < 8:
            assert prices == pytest.approx(fresh)  # each of the first samples moves the prices
        else:  # one of the last max(1, len / 8) windows' fits, no older
            lag = max(1, len(windows[-1]) // 8)
            assert any(prices == pytest.approx(f) for f in fits[-lag:])
        if i == 8:
            early = c.costs(8)
    assert c.costs(8)[1] > 1.5 * early[1]  # a sequence's price followed drafts growing dearer


def test_one_odd_drafted_step_does_not_by_itself_keep_drafts_out() -> None:
    c = StepCosts(prior_draft_cost=0.25, prior_sequence_cost=0.25, prior_samples=2)
    for _ in range(3):
        c.observe(1, 0, 0, 0.012)
    c.observe(1, 1, 4, 0.012 + 4 * 0.01)  # the first verify at a new shape, or a stall
    kappa, sigma = c.costs(1)
    assert kappa + sigma / 4 < 1.5 * (0.25 + 0.25 / 4)  # near the prior, not at 3.3
    c.observe(1, 1, 4, 0.012 + 40 * 0.012)  # each draft token dearer than a whole step: dropped
    assert len(c.drafted) == 1


def test_a_batch_size_kept_from_drafting_asks_for_a_probe_now_and_then() -> None:
    c = StepCosts(0.25, 0.25, draft_probe=3)
    for _ in range(2):
        c.observe(8, 0, 0, 0.05)
        assert not c.wants_draft_probe(8)
    c.observe(8, 0, 0, 0.05)
    assert c.wants_draft_probe(8)
    c.observe(8, 4, 16, 0.20)  # dearer than believed
    assert not c.wants_draft_probe(8)
    c.observe(8, 4, 4, 0.051)  # cheaper than believed: probe again at once
    assert c.wants_draft_probe(8)


def test_probes_that_find_drafts_as_dear_as_believed_come_further_apart() -> None:
    """Each probe where drafts do not pay costs a step's worth; one every `draft_probe`
    steps cost ~3% of a compute-bound batch of 16. Probes that confirm the cost double the
    wait (up to 16 times), one that finds drafts clearly cheaper starts over."""
    c = StepCosts(0.25, 0.25, draft_probe=3, probe_backoff_max=2)

    def plain_steps_until_probe() -> int:
        n = 0
        while not c.wants_draft_probe(8):
            c.observe(8, 0, 0, 0.05)
            n += 1
        return n

    c.observe(8, 0, 0, 0.05)
    waits = []
    for _ in range(4):
        waits.append(plain_steps_until_probe())
        c.observe(8, 4, 16, 0.20)  # as dear as (dearer than) believed
    assert waits == [2, 6, 12, 12]  # 3, 6, 12, then no further (the first plain step came before)
    assert plain_steps_until_probe() == 12
    c.observe(8, 4, 4, 0.0505)  # clearly cheaper than believed: probe again at once
    assert c.wants_draft_probe(8)
    c.observe(8, 4, 16, 0.20)  # that one as dear as believed: the waits start over
    assert plain_steps_until_probe() == 6


def test_a_probe_about_as_dear_as_predicted_does_not_call_the_next_at_once() -> None:
    c = StepCosts(0.25, 0.25, draft_probe=3)
    for _ in range(3):
        c.observe(8, 0, 0, 0.05)
    kappa, sigma = c.costs(8)
    predicted = (sigma * 4 + kappa * 16) * 0.05 / 8
    c.observe(8, 4, 16, 0.05 + 0.95 * predicted)  # below the prediction, within its noise
    assert not c.wants_draft_probe(8)


def test_a_batch_size_that_always_drafts_gets_a_plain_step_now_and_then() -> None:
    c = StepCosts(0.25, 0.25, plain_refresh=3)
    c.observe(4, 2, 8, 0.012)
    c.observe(4, 2, 8, 0.012)
    assert c.wants_plain(4)  # never timed without drafts: soon
    c.observe(4, 0, 0, 0.01)
    for _ in range(3):
        assert not c.wants_plain(4)
        c.observe(4, 2, 8, 0.012)
    assert c.wants_plain(4)
    c.observe(4, 0, 0, 0.01)
    assert not c.wants_plain(4)


# --- the Speculator over stand-ins ------------------------------------------------------------


@dataclass
class FakeSeq:
    request_id: str
    all_token_ids: list[int]
    max_total_tokens: int = 10_000
    num_computed: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_computed = len(self.all_token_ids) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append(self, token: int) -> None:
        self.all_token_ids.append(token)
        self.num_computed = len(self.all_token_ids) - 1

    def token_ids(self, start: int, end: int) -> list[int]:
        return self.all_token_ids[start:end]


class StreamDrafter:
    """Drafts each sequence's true continuation (`right`) or tokens it never produces."""

    def __init__(self, streams: dict[int, list[int]], right: bool) -> None:
        self.streams, self.right, self.calls = streams, right, 0

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        self.calls += 1
        stream = self.streams[token_ids[0]]
        if self.right:
            return stream[len(token_ids) : len(token_ids) + num_tokens]
        return [-1] * num_tokens


def speculator(gate: str = "auto") -> Speculator:
    return Speculator(EngineConfig(speculative_method="ngram", num_speculative_tokens=4, speculative_gate=gate))


def drive(spec: Speculator, seqs: list[FakeSeq], streams: dict[int, list[int]], steps: int,
          plain_s: float, per_draft_s: float, per_seq_s: float = 0.0) -> tuple[int, int]:
    """Steps the stand-ins as the engine would: each takes its draft's agreeing prefix plus
    one token (or one token), and the step is timed as plain_s + per_draft_s per draft token
    + per_seq_s per drafted sequence. Returns (draft tokens, accepted)."""
    drafted = accepted = 0
    for _ in range(steps):
        drafts = spec.propose(seqs)
        extend = []
        tokens = 0
        for s in seqs:
            stream, draft = streams[s.all_token_ids[0]], drafts.get(s.request_id, [])
            take = 0
            while take < len(draft) and draft[take] == stream[s.num_tokens + take]:
                take += 1
            for _ in range(take + 1):
                s.append(stream[s.num_tokens])
            drafted, accepted, tokens = drafted + len(draft), accepted + take, tokens + take + 1
            if draft:
                extend.append(BatchEntry(s, s.num_computed, 1 + len(draft), True, draft))
        decode = [BatchEntry(s, s.num_computed, 1, True) for s in seqs if s.request_id not in drafts]
        seconds = plain_s + per_draft_s * sum(len(d) for d in drafts.values()) + per_seq_s * len(drafts)
        spec.observe_step(decode, extend, seconds, tokens)
    return drafted, accepted


def count_verified(spec: Speculator) -> dict[str, int]:
    """From now on, the draft tokens each sequence is given to verify, by request id."""
    verified: dict[str, int] = {}
    propose = spec.propose

    def counted(running: list[FakeSeq]) -> dict[str, list[int]]:
        drafts = propose(running)
        for rid, draft in drafts.items():
            verified[rid] = verified.get(rid, 0) + len(draft)
        return drafts

    spec.propose = counted  # type: ignore[method-assign]
    return verified


def make(n: int) -> tuple[list[FakeSeq], dict[int, list[int]]]:
    streams = {i: [i] + [random.Random(i).randrange(1000, 2000) for _ in range(5000)] for i in range(n)}
    return [FakeSeq(f"r{i}", streams[i][:20]) for i in range(n)], streams


def test_wrong_drafts_at_batch_eight_stop_being_verified_but_are_still_watched() -> None:
    seqs, streams = make(8)
    spec = speculator()
    spec.drafter = StreamDrafter(streams, right=False)
    # a draft token costs half a decoded token's share: wrong drafts are pure loss
    early, _ = drive(spec, seqs, streams, 10, plain_s=0.048, per_draft_s=0.003)
    assert early > 0  # the priors let it try
    later, _ = drive(spec, seqs, streams, 40, plain_s=0.048, per_draft_s=0.003)
    assert later == 0
    scored = []
    spec._observe = lambda state, known, accepted: scored.append((known, accepted))  # type: ignore[method-assign]
    drive(spec, seqs, streams, 40, 0.048, 0.003)
    # each sequence's draft is scored every few steps (a shadow: looked up, never verified)
    every = spec.gate.shadow_every
    assert 8 * (40 // every - 1) <= len(scored) <= 8 * (40 // every + 1)
    assert all(accepted == 0 for _, accepted in scored)


class HalfShortDrafter(StreamDrafter):
    """The true continuation: as long as asked for sequences r0-r3, one token for r4-r7."""

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        return super().propose(token_ids, num_tokens if token_ids[0] < 4 else min(num_tokens, 1))


def test_a_plan_is_priced_on_the_draft_each_sequence_has() -> None:
    seqs, streams = make(8)
    spec = speculator()
    spec.drafter = HalfShortDrafter(streams, right=True)
    # A drafted sequence costs a decoded token's share, a draft token a quarter: four right
    # tokens gain 4 for 2, one right token gains 1 for 1.25, a loss. The one-token drafts'
    # later positions are never seen (acceptance there is the prior's, pulled up by r0-r3),
    # so a plan priced as if each had four tokens verifies them.
    drive(spec, seqs, streams, 20, plain_s=0.048, per_draft_s=0.0015, per_seq_s=0.006)
    verified = count_verified(spec)
    drive(spec, seqs, streams, 60, plain_s=0.048, per_draft_s=0.0015, per_seq_s=0.006)
    assert sum(verified.get(f"r{i}", 0) for i in range(4)) >= 60 * 4 * 4 * 0.9
    assert sum(verified.get(f"r{i}", 0) for i in range(4, 8)) <= 4  # a probe at most


def test_right_drafts_are_verified_in_full_at_batch_eight_when_they_pay() -> None:
    seqs, streams = make(8)
    spec = speculator()
    spec.drafter = StreamDrafter(streams, right=True)
    drive(spec, seqs, streams, 10, 0.048, 0.0015)
    drafted, accepted = drive(spec, seqs, streams, 30, 0.048, 0.0015)
    # all but the occasional plain step that refreshes the time drafts are measured against
    assert drafted >= 30 * 8 * 4 * 0.9 and accepted == drafted


def test_drafted_steps_that_go_as_predicted_leave_the_plans_alone() -> None:
    seqs, streams = make(8)
    spec = speculator()
    spec.drafter = StreamDrafter(streams, right=True)
    drive(spec, seqs, streams, 40, 0.048, 0.0015)
    # the stand-in's steps cost what the fit says and every draft is right: as predicted or better
    assert spec.outcomes.discount(8) >= 0.97


def test_a_plan_expected_to_gain_under_three_percent_is_not_verified() -> None:
    seqs, streams = make(8)
    spec = speculator()
    spec.drafter = StreamDrafter(streams, right=True)
    drive(spec, seqs, streams, 40, 0.048, 0.003)  # drafts pay well here: every sequence drafts
    g = spec.gate
    prior = spec.acceptance.gains(4, [g.prior_acceptance] * 4, g.prior_weight)
    gains = [spec._seqs[s.request_id].profile.gains(4, prior, g.prior_weight) for s in seqs]
    kappa, sigma = spec.costs.costs(8)
    predicted = expected_speedup(gains, plan_draft_lengths(gains, 8, kappa, sigma), 8, kappa, sigma)
    assert g.min_step_speedup == pytest.approx(1.03)
    for after_discount, drafts in [(1.02, False), (1.04, True)]:
        spec.outcomes.discount = lambda batch, f=after_discount / predicted: f  # type: ignore[method-assign]
        spec.costs.drafted_since_plain[8] = 0  # not a step kept plain to refresh its time
        assert bool(spec.propose(seqs)) == drafts


def test_where_drafted_steps_gave_less_than_predicted_the_gate_steps_aside() -> None:
    seqs, streams = make(8)
    spec = speculator()
    spec.drafter = StreamDrafter(streams, right=True)
    drive(spec, seqs, streams, 10, 0.048, 0.0015)
    assert drive(spec, seqs, streams, 5, 0.048, 0.0015)[0] > 0
    for _ in range(60):  # drafted steps near batch 8 gave a tenth of the speedup predicted for them
        spec.outcomes.observe(8, 2.0, 0.2)
    assert spec.outcomes.discount(8) < 0.3 and spec.outcomes.discount(10) < 0.3
    assert drive(spec, seqs, streams, 20, 0.048, 0.0015)[0] == 0
    # far from batch 8 what was seen there says nothing: a pair of sequences drafts
    assert spec.outcomes.discount(2) == 1.0
    assert drive(spec, seqs[:2], streams, 10, 0.012, 0.0004)[0] > 0


def test_outcomes_weigh_recent_drafted_steps_and_pool_nearby_batch_sizes() -> None:
    o = DraftOutcomes(decay=0.5, prior_steps=1.0, near=1.5)
    assert o.discount(8) == 1.0
    o.observe(8, 2.0, 1.0)
    assert o.discount(8) == pytest.approx((1 + 1) / (1 + 2))
    o.observe(8, 1.0, 1.0)  # the older step now counts half
    assert o.discount(8) == pytest.approx((1 + 0.5 + 1) / (1 + 1 + 1))
    o.observe(12, 1.0, 0.0)
    assert o.discount(10) == pytest.approx((1 + 1.5 + 0) / (1 + 2 + 1))  # 8 and 12 are both near 10
    assert o.discount(16) == pytest.approx((1 + 0) / (1 + 1))  # 12 is near 16, 8 is not
    assert o.discount(3) == 1.0
    o.observe(8, 0.0, 1.0)  # no prediction: nothing to compare
    assert o.discount(3) == 1.0 and o.sums[8] == [1.5, 2.0]


def test_a_sequence_kept_from_drafting_drafts_again_when_its_drafts_turn_right() -> None:
    seqs, streams = make(8)
    spec = speculator()
    wrong = StreamDrafter(streams, right=False)
    spec.drafter = wrong
    drive(spec, seqs, streams, 40, 0.048, 0.003)
    assert drive(spec, seqs, streams, 10, 0.048, 0.003)[0] == 0
    spec.drafter = StreamDrafter(streams, right=True)  # the text starts repeating
    drive(spec, seqs, streams, 40, 0.048, 0.003)  # shadow drafts, scored as they come true
    drafted, accepted = drive(spec, seqs, streams, 20, 0.048, 0.003)
    assert drafted > 20 * 8 * 2 and accepted == drafted


def test_drafts_kept_out_by_a_bad_cost_reading_come_back_when_it_is_measured_again() -> None:
    seqs, streams = make(1)
    spec = speculator()
    spec.drafter = StreamDrafter(streams, right=True)
    for _ in range(spec.costs.drafted.maxlen):  # a bad moment: every drafted step looked dear
        spec.costs.observe(1, 0, 0, 0.010)
        spec.costs.observe(1, 1, 4, 0.010 + 4 * 0.012)
    spec.costs.observe(1, 0, 0, 0.010)
    kappa, sigma = spec.costs.costs(1)
    assert 4 * kappa + sigma > 4.5  # no draft of 4 tokens, however right, pays at that
    drive(spec, seqs, streams, 60, plain_s=0.010, per_draft_s=0.0004)  # probes re-measure it
    drafted, accepted = drive(spec, seqs, streams, 20, 0.010, 0.0004)
    assert drafted >= 20 * 4 * 0.9 and accepted == drafted


def test_always_drafts_every_match_whatever_it_costs() -> None:
    seqs, streams = make(8)
    spec = speculator("always")
    spec.drafter = StreamDrafter(streams, right=False)
    drafted, _ = drive(spec, seqs, streams, 20, 0.048, 0.003)
    assert drafted == 20 * 8 * 4


def test_sequences_that_left_are_forgotten() -> None:
    seqs, streams = make(3)
    spec = speculator()
    spec.drafter = StreamDrafter(streams, right=True)
    drive(spec, seqs, streams, 3, 0.01, 0.0001)
    assert set(spec._seqs) == {"r0", "r1", "r2"}
    spec.propose(seqs[:1])
    assert set(spec._seqs) == {"r0"}


def test_the_ngram_drafter_drafts_from_each_sequences_index_as_from_its_whole_context() -> None:
    """The real drafter through the Speculator: each decoding sequence's draft is what
    propose_ngram gives over its whole context, step after step, from an index kept per
    sequence (brought up to date with the tokens it gained, built again if its tokens ever
    shrink, dropped when it leaves)."""
    rng = random.Random(7)
    seqs = [FakeSeq(f"r{i}", [rng.randrange(4) for _ in range(30)]) for i in range(3)]
    spec = speculator(gate="always")
    for step in range(40):
        drafts = spec.propose(seqs)
        for s in seqs:
            expected = propose_ngram(s.all_token_ids, 4, 2, 4)[:4]
            assert drafts.get(s.request_id, []) == expected, (step, s.request_id)
            for _ in range(rng.randrange(1, 4)):
                s.append(rng.randrange(4))
        if step == 20:  # a sequence's tokens shrink: its index is built again
            del seqs[0].all_token_ids[-10:]
            seqs[0].num_computed = seqs[0].num_tokens - 1
    assert set(spec._indexes) == {"r0", "r1", "r2"}
    spec.propose(seqs[1:])
    assert set(spec._indexes) == {"r1", "r2"}


class FaultyDrafter(StreamDrafter):
    """The true continuation, except that looking up r3's draft raises."""

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        if token_ids[0] == 3:
            raise RuntimeError("lookup exploded")
        return super().propose(token_ids, num_tokens)


@pytest.mark.parametrize("gate", ["auto", "always"])
def test_a_lookup_that_raises_costs_only_that_sequence_its_draft(gate: str, caplog: pytest.LogCaptureFixture) -> None:
    seqs, streams = make(4)
    spec = speculator(gate)
    spec.drafter = FaultyDrafter(streams, right=True)
    verified = count_verified(spec)
    drive(spec, seqs, streams, 40, plain_s=0.02, per_draft_s=0.0002)  # drafts pay well
    assert "r3" not in verified and all(verified.get(f"r{i}", 0) >= 40 for i in range(3))
    assert seqs[3].num_tokens == 20 + 40  # it decoded a token every step
    assert "lookup exploded" in caplog.text
