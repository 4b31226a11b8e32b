"""Whether a draft pays: how many draft tokens each decoding sequence verifies this step.

Verifying a draft is not free. Each draft token is one more row through every matrix, the
LM head and the sampler; each drafted sequence also runs its attention as an extend over
its prefix (dearer than the decode kernel's one row) and its draft through the verify
sampler. At batch 8+ a step is no longer bound by reading the weights alone, so those costs
are a real share of the step. In units of one decoded token's share of the step (T(B) / B
for the step without drafts at batch size B):

- a drafted sequence costs `sequence_cost` (sigma) plus `draft_cost` (kappa) per draft
  token; both are measured (engine/sched/spec_stats.py): small at batch 1, where reading
  the weights dominates, larger as the batch grows;
- the j-th draft token of a sequence yields a token with probability g_j (the chance the
  first j draft tokens are all accepted: non-increasing in j), from its recent acceptance.

The step yields B + sum of the chosen g in time B + sum of the chosen costs. Maximising
that ratio over every choice of draft prefixes is a separable fractional program, solved
exactly by Dinkelbach's iteration: for a ratio lambda each sequence independently takes
the prefix that maximises (its gains - lambda * its cost), or none; lambda becomes the
ratio of that choice; repeat until it stops rising (a few rounds). The choice is then the
best there is, and none at all unless drafting beats decoding plainly (ratio 1).

Pure functions of their inputs, tested without a model (tests/engine/test_spec_policy.py).
"""

from __future__ import annotations

from collections.abc import Sequence

# Asked of every draft on top of breaking even: the measured costs and acceptance are noisy
# estimates, and a draft that merely breaks even is not worth the risk of a slower step.
MARGIN = 0.1
_ROUNDS = 32  # Dinkelbach converges in a handful; a bound, not a tolerance


def plan_draft_lengths(
    gains: Sequence[Sequence[float]], batch_size: int, draft_cost: float, sequence_cost: float = 0.0,
    margin: float = MARGIN,
) -> list[int]:
    """Draft tokens each candidate sequence verifies this step.

    gains[i][j]: probability that candidate i's (j+1)-th draft token is accepted along with
    all before it (non-increasing in j; its length is the most tokens it may draft).
    batch_size: decoding sequences this step (candidates and the rest), each yielding one
    token without drafts. draft_cost (kappa) per draft token and sequence_cost (sigma) per
    drafted sequence, in decoded tokens' worth (T(B) / B each), both priced `margin`
    higher. Returns one length per candidate (0: decode plainly): the lengths that
    maximise `expected_speedup` at those prices."""
    lengths = [0] * len(gains)
    if batch_size <= 0 or not gains:
        return lengths
    kappa = max(draft_cost, 0.0) * (1.0 + margin)
    sigma = max(sequence_cost, 0.0) * (1.0 + margin)
    ratio = 1.0  # decoding plainly
    for _ in range(_ROUNDS):
        choice = [_best_prefix(g, ratio, kappa, sigma) for g in gains]
        better = expected_speedup(gains, choice, batch_size, kappa, sigma)
        if better <= ratio * (1.0 + 1e-12):
            break
        lengths, ratio = choice, better
    return lengths


def _best_prefix(gains: Sequence[float], ratio: float, kappa: float, sigma: float) -> int:
    """The draft length that maximises gain - ratio * cost for one sequence (0 if none is
    positive)."""
    best_n, best, total = 0, 0.0, 0.0
    for n, g in enumerate(gains, start=1):
        total += g
        value = total - ratio * (sigma + kappa * n)
        if value > best:
            best_n, best = n, value
    return best_n


def expected_speedup(gains: Sequence[Sequence[float]], lengths: Sequence[int], batch_size: int,
                     draft_cost: float, sequence_cost: float = 0.0) -> float:
    """Tokens per second with these draft lengths over tokens per second without (the
    quantity `plan_draft_lengths` raises): what a step is expected to gain."""
    if batch_size <= 0:
        return 1.0
    extra = sum(sum(g[:n]) for g, n in zip(gains, lengths))
    cost = sum(max(sequence_cost, 0.0) + max(draft_cost, 0.0) * n for n in lengths if n)
    return (batch_size + extra) / (batch_size + cost)


def draft_cost(batch_size: int, plain_step_seconds: float, seconds: float) -> float:
    """`seconds` (the measured extra time of a draft token, or of a drafted sequence) in
    decoded tokens' worth at this batch size: kappa or sigma."""
    if batch_size <= 0 or plain_step_seconds <= 0:
        return float("inf")
    return seconds * batch_size / plain_step_seconds


def prior_cost(batch_size: int, most: float, half_batch: int) -> float:
    """A cost (kappa or sigma) to assume before one is measured: `most` * B / (B + half_batch).
    A step costs about a + b * B (reading the weights, then work per row), and a draft's row
    about a fixed share of b, so its cost in decoded tokens' worth, c * B / (a + b * B), rises
    from near 0 at batch 1 toward c / b, halfway at B = a / b. half_batch 0: `most` always."""
    if half_batch <= 0:
        return most
    return most * batch_size / (batch_size + half_batch)
