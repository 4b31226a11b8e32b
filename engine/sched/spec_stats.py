"""What speculation's gate (engine/sched/spec_policy.py) decides from: each sequence's recent
acceptance and the measured cost of a draft token.

Acceptance is learnt from the token stream, not from the verify step: a draft proposed at
position p is compared with the tokens the sequence actually has at p, p+1, ... once they
exist. For a verified draft that is exactly what the sampler accepted (greedy keeps the
agreeing prefix; speculative sampling keeps d with probability p(d) and otherwise samples
from p without d, so the token equals d exactly when d was accepted). For a *shadow* draft
— looked up for a sequence the gate kept from drafting, never verified — it is what would
have been accepted (greedy), or a draw with the same probability (sampling: the token
equals d with probability p(d)). So a sequence the gate stepped aside for keeps an honest
estimate, and drafts again when its text starts repeating.

Costs are timed steps: the median time of a step without drafts at each batch size (a
median, because on a shared machine a step now and then takes far longer for reasons of its
own), and what drafts added over it, fitted as a cost per drafted sequence (its attention
runs as an extend; its draft goes through the verify sampler) plus a cost per draft token
(a row through every matrix and the LM head). Both terms are needed: with one per-token
cost, short drafts look dear (the per-sequence part spread over few tokens), the gate
shortens drafts, they look dearer still, and drafting stops where it would have paid.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

from preheat.engine.sched.spec_policy import prior_cost


def resolve(draft: Sequence[int], tokens_after: Sequence[int]) -> tuple[int, int, bool]:
    """Compares a draft with the tokens the sequence has since the draft's first position.
    Returns (positions known, of which accepted, final): final once the draft's fate is
    sealed (a mismatch, or every draft token matched); before that the matching tokens so
    far are known accepted and the rest unknown."""
    accepted = 0
    for d, t in zip(draft, tokens_after):
        if d != t:
            return len(draft), accepted, True  # the first mismatch ends it: later tokens all fail
        accepted += 1
    return accepted, accepted, accepted == len(draft)


class AcceptanceProfile:
    """Per draft position j, an exponentially weighted estimate of P(the first j+1 draft
    tokens are all accepted). `decay` is the weight an old observation keeps per new one."""

    def __init__(self, length: int, decay: float) -> None:
        self.hits = [0.0] * length
        self.trials = [0.0] * length
        self.decay = decay

    def observe(self, known: int, accepted: int) -> None:
        for j in range(min(known, len(self.trials))):
            self.trials[j] = self.decay * self.trials[j] + 1.0
            self.hits[j] = self.decay * self.hits[j] + (1.0 if j < accepted else 0.0)

    def gains(self, limit: int, prior: Sequence[float], prior_weight: float) -> list[float]:
        """The first `limit` positions' estimates, each pulled toward `prior` by
        `prior_weight` pseudo-observations, made non-increasing (accepting j+1 tokens
        needs the first j)."""
        out: list[float] = []
        last = 1.0
        for j in range(min(limit, len(self.trials))):
            g = (self.hits[j] + prior_weight * prior[j]) / (self.trials[j] + prior_weight)
            last = min(last, g)
            out.append(last)
        return out


class StepCosts:
    """Measured step times: by batch size, steps without drafts; pooled, what drafts added
    to a step over that (seconds per drafted sequence and per draft token, a least-squares
    fit over the last `window` drafted steps, pulled toward the prior as if it were
    `prior_samples` of them, so one odd step — the first at a new shape, a stall of the
    machine — cannot by itself decide)."""

    def __init__(self, prior_draft_cost: float, prior_sequence_cost: float, prior_half_batch: int = 0,
                 window: int = 32, plain_window: int = 15, plain_refresh: int = 32, draft_probe: int = 32,
                 prior_samples: int = 2, probe_backoff_max: int = 4) -> None:
        self.prior_most = (prior_draft_cost, prior_sequence_cost)
        self.prior_half_batch = prior_half_batch
        self.plain_refresh = plain_refresh
        self.draft_probe = draft_probe
        self.prior_samples = prior_samples
        self.plain_window = plain_window
        self.plain: dict[int, deque[float]] = {}
        self.drafted: deque[tuple[int, int, float]] = deque(maxlen=window)  # (sequences, tokens, extra s)
        self.drafted_since_plain: dict[int, int] = {}
        self.plain_since_drafted: dict[int, int] = {}
        # Per batch size, how many probes in a row found drafts as dear as believed: each
        # doubles the wait before the next, up to 2 ** probe_backoff_max times draft_probe.
        # A probe is a drafted step the gate's own prices would have kept out, so where
        # drafts do not pay each one costs; where a step is bound by its arithmetic (a bf16
        # batch of 16 on the Zen 4 host: a verify step with 4-token drafts took ~3.4x a plain
        # one) a probe every 32 steps cost ~3% of the throughput.
        self.probe_backoff_max = probe_backoff_max
        self.probe_backoff: dict[int, int] = {}
        # The gate asks for prices every step; a fit is redone only when drafted steps were
        # added (one while the window is filling; with a full window of 32, every 4th: a fit
        # is ~30 us of Python, and at batch 1 two steps in three draft, so refitting after
        # each cost ~0.6% of a 5 ms step to move prices by a sample in 32) or when the prior
        # it is pulled toward moved by more than FIT_TOLERANCE (the prior's seconds follow
        # the plain step's median, which moves a little every step).
        self._drafted_version = 0
        self._fits: dict[int, tuple[int, float, tuple[float, float]]] = {}
        self._plain_median: dict[int, float] = {}

    def observe(self, batch_size: int, drafted_seqs: int, draft_tokens: int, seconds: float) -> None:
        if batch_size <= 0:
            return
        if draft_tokens == 0:
            self.plain.setdefault(batch_size, deque(maxlen=self.plain_window)).append(seconds)
            self._plain_median.pop(batch_size, None)
            self.drafted_since_plain[batch_size] = 0
            self.plain_since_drafted[batch_size] = self.plain_since_drafted.get(batch_size, 0) + 1
            return
        probe = self.wants_draft_probe(batch_size)
        self.drafted_since_plain[batch_size] = self.drafted_since_plain.get(batch_size, 0) + 1
        self.plain_since_drafted[batch_size] = 0
        plain = self.plain_seconds(batch_size)
        if plain is None:
            return  # nothing to compare with yet
        extra = seconds - plain  # may be negative: noise; the fit copes
        if extra > plain * (drafted_seqs + draft_tokens):
            return  # each draft token dearer than a whole step: a stall, not a cost
        kappa, sigma = self.costs(batch_size)
        predicted = (sigma * drafted_seqs + kappa * draft_tokens) * plain / batch_size
        self.drafted.append((drafted_seqs, draft_tokens, extra))
        self._drafted_version += 1
        if extra < CHEAPER * predicted:
            # Cheaper than believed: if drafts were being kept out, probe again next step, so
            # a cost measured in a bad moment is outvoted in a few steps, not a few hundred.
            # (Clearly cheaper: a step as dear as predicted is below it half the time, and
            # each such probe called the next.)
            self.probe_backoff[batch_size] = 0
            self.plain_since_drafted[batch_size] = self.draft_probe
        elif probe:
            self.probe_backoff[batch_size] = min(self.probe_backoff_max, self.probe_backoff.get(batch_size, 0) + 1)

    def plain_seconds(self, batch_size: int) -> float | None:
        """Median step time without drafts at this batch size, or at the nearest one seen."""
        if batch_size not in self.plain:
            if not self.plain:
                return None
            batch_size = min(self.plain, key=lambda b: (abs(b - batch_size), b))
        median = self._plain_median.get(batch_size)
        if median is None:
            median = self._plain_median[batch_size] = statistics.median(self.plain[batch_size])
        return median

    def costs(self, batch_size: int) -> tuple[float, float]:
        """(kappa, sigma) at this batch size: a draft token's and a drafted sequence's extra
        time in decoded tokens' worth (spec_policy); the prior until steps are timed."""
        prior = self.prior(batch_size)
        plain = self.plain_seconds(batch_size)
        if plain is None or not self.drafted:
            return prior
        unit = plain / batch_size  # one decoded token's share of the step
        fit = self._fits.get(batch_size)
        stale = max(1, len(self.drafted) // REFIT_SHARE)
        if fit is None or self._drafted_version - fit[0] >= stale or abs(fit[1] / unit - 1.0) > FIT_TOLERANCE:
            seconds = fit_costs(self.drafted, prior[0] * unit, prior[1] * unit, self.prior_samples)
            fit = self._fits[batch_size] = (self._drafted_version, unit, seconds)
        per_token, per_seq = fit[2]
        return per_token / unit, per_seq / unit

    def prior(self, batch_size: int) -> tuple[float, float]:
        """(kappa, sigma) before anything is measured: with `prior_half_batch`, rising with
        the batch as a step's share per token falls (spec_policy.prior_cost)."""
        kappa, sigma = self.prior_most
        return prior_cost(batch_size, kappa, self.prior_half_batch), prior_cost(batch_size, sigma, self.prior_half_batch)

    def wants_plain(self, batch_size: int) -> bool:
        """True when this batch size has drafted for `plain_refresh` steps in a row (two,
        while it has no plain step timed at all): one step without drafts then gives, or
        refreshes, the time drafted steps are measured against (contexts grow and the
        machine's load moves, so an old one drifts)."""
        due = self.plain_refresh if batch_size in self.plain else min(2, self.plain_refresh)
        return self.drafted_since_plain.get(batch_size, 0) >= due

    def wants_draft_probe(self, batch_size: int) -> bool:
        """True when this batch size has gone `draft_probe` timed steps without a draft (twice
        that, four times ... after probes that found drafts as dear as believed): the cost
        that keeps drafts out is then measured again (load changes; it may have been
        measured in a bad moment), if drafts could pay at a lower cost."""
        wait = self.draft_probe << self.probe_backoff.get(batch_size, 0)
        return self.plain_since_drafted.get(batch_size, 0) >= wait


class DraftOutcomes:
    """What drafted steps gave against what the gate predicted for them, by batch size.

    The gate predicts a plan's speedup from each sequence's acceptance and the fitted
    prices, and both lean optimistic where it matters. The sequences it picks are those
    whose acceptance looks best, so their estimates lean high (the winner's curse). And a
    drafted step can have a fixed cost of its own (on a GPU it leaves the CUDA graphs; on
    the CPU, before verify steps ran on the decode stack, it left the stack) that the fit
    spreads over the drafted sequences, so a step drafting one or two is priced low: on
    the Zen 4 host at batch 16 (bf16, off the stack) one sequence's 4-token draft added 41%
    to the step, each further one ~12%. Measured there on edits at batch 16, the steps the
    gate drafted were predicted 1.03-1.09x and gave 0.93-0.97x.

    So each drafted step's realized speedup — its tokens over its time, against the batch's
    tokens over a plain step's time — is set against its prediction, and the gate verifies
    a plan only where its prediction, scaled by realized / predicted at nearby batch sizes,
    still beats decoding plainly. Sums decay per drafted step (`decay`), start from
    `prior_steps` steps that went as predicted, and pool batch sizes within a factor `near`
    of each other (a step's costs move with the batch size)."""

    def __init__(self, decay: float = 0.95, prior_steps: float = 4.0, near: float = 1.5) -> None:
        self.decay = decay
        self.prior_steps = prior_steps
        self.near = near
        self.sums: dict[int, list[float]] = {}  # batch size -> [realized, predicted], decayed

    def observe(self, batch_size: int, predicted: float, realized: float) -> None:
        if batch_size <= 0 or not (predicted > 0 and realized >= 0):
            return
        sums = self.sums.setdefault(batch_size, [0.0, 0.0])
        sums[0] = self.decay * sums[0] + realized
        sums[1] = self.decay * sums[1] + predicted

    def discount(self, batch_size: int) -> float:
        """Realized over predicted speedup of drafted steps near this batch size (1 before
        any)."""
        realized = predicted = self.prior_steps
        for b, (r, p) in self.sums.items():
            if batch_size <= b * self.near and b <= batch_size * self.near:
                realized, predicted = realized + r, predicted + p
        return realized / predicted


RIDGE = 0.25
FIT_TOLERANCE = 0.01  # refit when the prior's unit moved by more than this share
REFIT_SHARE = 8  # refit once new drafted steps reach this share (1/n) of the window
CHEAPER = 0.8  # a drafted step's extra time under this share of the predicted: drafts are cheaper


def fit_costs(samples: Sequence[tuple[int, int, float]], prior_token: float, prior_seq: float,
              prior_samples: int) -> tuple[float, float]:
    """extra = per_seq * sequences + per_token * tokens over the samples: the split between
    the two from least squares pulled lightly toward the prior's split (a ridge worth
    `RIDGE` typical samples: it settles the split when every draft had the same length),
    the level from the median of each sample's extra over that fit's (the prior voting as
    `prior_samples` of them), so a stall or two cannot move it. Returns (per_token,
    per_seq), neither below 0."""
    per_token, per_seq = _ridge(samples, prior_token, prior_seq, RIDGE)
    if per_token <= 0 and per_seq <= 0:
        per_token, per_seq = prior_token, prior_seq
    d_mean = sum(d for d, _, _ in samples) / len(samples)
    k_mean = sum(k for _, k, _ in samples) / len(samples)
    at_mean = per_seq * d_mean + per_token * k_mean
    ratios = [e / (per_seq * d + per_token * k) for d, k, e in samples]
    ratios += [(prior_seq * d_mean + prior_token * k_mean) / at_mean] * prior_samples
    scale = max(0.0, statistics.median(ratios))
    return per_token * scale, per_seq * scale


def _ridge(samples: Sequence[tuple[int, int, float]], prior_token: float, prior_seq: float,
           prior_samples: float) -> tuple[float, float]:
    n = len(samples)
    sdd = sum(d * d for d, _, _ in samples)
    skk = sum(k * k for _, k, _ in samples)
    sdk = sum(d * k for d, k, _ in samples)
    sde = sum(d * e for d, _, e in samples)
    ske = sum(k * e for _, k, e in samples)
    lam_d = prior_samples * sdd / max(n, 1) or 1e-9
    lam_k = prior_samples * skk / max(n, 1) or 1e-9
    a, b, c = sdd + lam_d, sdk, skk + lam_k
    y1, y2 = sde + lam_d * prior_seq, ske + lam_k * prior_token
    det = a * c - b * b
    per_seq = (y1 * c - b * y2) / det
    per_token = (a * y2 - b * y1) / det
    if per_seq < 0:  # refit the other with this one at 0
        per_seq, per_token = 0.0, (ske + lam_k * prior_token) / c
    if per_token < 0:
        per_token, per_seq = 0.0, max(0.0, (sde + lam_d * prior_seq) / a)
    return per_token, per_seq
