"""Speculative decoding: prompt-lookup (n-gram) drafts and the rules that accept them.

A decode step reads every weight once to produce one token per sequence; on a
memory-bound step, running k+1 tokens of the same sequence costs little more than one. So
the engine guesses the next k tokens cheaply (a *draft*), runs the last known token plus
the draft in one forward pass (an extend of k+1 tokens over the cached prefix) and keeps the
longest prefix of the draft the model agrees with, plus one token of its own. Every step
still yields at least one token; a good draft yields up to k+1.

The drafter is vLLM's and SGLang's `ngram` method ("prompt lookup decoding"): text often
repeats itself (code edits, quoting a document, JSON keys, a model stuck in a loop), so the
tokens that followed the latest earlier occurrence of the last n tokens are a good guess.

Acceptance keeps the output exactly what decoding without a draft gives:
- greedy: a draft token is kept while it equals the argmax at its position; the first
  mismatch is replaced by that argmax (so the result is token for token the greedy output);
- sampling: the draft is deterministic (a point mass q = one-hot(d)), so standard
  speculative sampling (Leviathan et al., Chen et al.) accepts d with probability
  min(1, p(d) / q(d)) = p(d) and, on rejection, samples from the residual
  max(p - q, 0) / (1 - p(d)), i.e. p with d removed and renormalised. Then
  P(token = x) = p(d)[x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d] = p(x): the
  distribution is the target's, position by position.
Everything here is a pure function of its inputs (and, for sampling, of the request's own
generator), tested without a model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], num_tokens: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to `num_tokens` draft tokens: for n from `lookup_max` down to `lookup_min`, find the
    latest earlier occurrence of the last n tokens and propose the tokens that followed it.
    Returns [] when no n-gram matches (the sequence then decodes one token as usual)."""
    total = len(token_ids)
    if num_tokens <= 0 or total < lookup_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, total - 1), lookup_min - 1, -1):
        suffix = tokens[total - n :]
        # Windows that end before the last token: each has a successor, none is the suffix itself.
        windows = sliding_window_view(tokens[: total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + num_tokens].tolist()
    return []


# Up to this many new tokens (a decode step's token, an accepted draft) are indexed one window
# at a time: building n shifted slices and zipping them cost ~5 us for a single token, a
# direct write per window ~1 us (the gate indexes every decoding sequence every step).
_FEW = 8


class NgramIndex:
    """`propose_ngram` over one sequence's growing tokens, kept up to date as they arrive:
    per n-gram length, a dict from each n-gram to the position after its latest occurrence
    that has a successor. A token added costs one dict write per length and a proposal one
    lookup per length, where propose_ngram compares the last n tokens with every window of
    the context on every call (~76 us at ~300 tokens: the speculation gate's lookups, a few a
    step at batch 8, took ~2% of a bf16 step on the Zen 4 host; benchmarks/results/
    speculation.md). Proposes exactly what propose_ngram proposes for the same tokens
    (tests/engine/test_spec_decode.py)."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self.tokens: list[int] = []
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lookup_min, lookup_max + 1)}

    @property
    def length(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Appends tokens; every window they give a successor to is indexed. The windows
        t[end - n:end] for each new `end` are zipped from n shifted slices and written in
        order (a later occurrence overwrites an earlier), all in C: a prompt of ~600 tokens
        is indexed in ~0.1 ms where a Python loop over its windows took ~1 ms, a share of a
        step the gate paid for every new sequence."""
        t = self.tokens
        old = len(t)
        t.extend(map(int, new_tokens))
        total = len(t)
        if total - old <= _FEW:  # a decode step's token or an accepted draft: a write per window
            for n, latest in self._latest.items():
                for end in range(max(old, n), total):
                    latest[tuple(t[end - n : end])] = end
            return
        for n, latest in self._latest.items():
            first = max(old, n)  # the first window end with n tokens before it
            if first < total:
                latest.update(zip(zip(*(t[first - n + i : total - n + i] for i in range(n))), range(first, total)))

    def propose(self, num_tokens: int) -> list[int]:
        t, total = self.tokens, len(self.tokens)
        if num_tokens <= 0 or total < self.lookup_min + 1:
            return []
        for n in range(min(self.lookup_max, total - 1), self.lookup_min - 1, -1):
            end = self._latest[n].get(tuple(t[total - n :]))
            if end is not None:
                return t[end : end + num_tokens]
        return []


class NgramDrafter:
    """The `ngram` method's drafter, configured once (--prompt-lookup-min/max). The engine
    drafts for each decoding sequence from an `index()` of its own, kept up to date; a
    stand-in without `index` is called as `propose(token_ids, num_tokens)` with the whole
    context (tests use an oracle to drive acceptance)."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        return propose_ngram(token_ids, num_tokens, self.lookup_min, self.lookup_max)

    def index(self) -> NgramIndex:
        return NgramIndex(self.lookup_min, self.lookup_max)


def draft_limit(num_speculative_tokens: int, num_tokens: int, max_total_tokens: int) -> int:
    """Most draft tokens a sequence may verify this step: accepted drafts plus the model's own
    token must not run past the request's length limit."""
    return max(0, min(num_speculative_tokens, max_total_tokens - num_tokens - 1))


def accept_greedy(targets: Sequence[int], draft: Sequence[int]) -> list[int]:
    """targets[i] is the argmax after the draft's first i tokens (len(draft) + 1 of them).
    Returns the tokens this step yields: the agreeing draft prefix, then the model's token."""
    out: list[int] = []
    for i, token in enumerate(draft):
        if targets[i] != token:
            out.append(int(targets[i]))
            return out
        out.append(int(token))
    out.append(int(targets[len(draft)]))
    return out


def _race(weights: torch.Tensor, generator: torch.Generator) -> int:
    """A draw proportional to `weights` (need not sum to 1): argmax(w / E), E ~ Exp(1)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())


def accept_sampled(probs: torch.Tensor, draft: Sequence[int], generator: torch.Generator) -> list[int]:
    """probs [len(draft) + 1, V]: the target distribution after the draft's first i tokens.
    Accepts draft token d with probability p(d); on the first rejection the token comes from
    p with d removed (renormalised); when all are accepted a bonus token comes from the last
    row. Returns the tokens this step yields."""
    out: list[int] = []
    for i, token in enumerate(draft):
        p = probs[i]
        p_token = float(p[token])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u < p_token:
            out.append(int(token))
            continue
        residual = p.clone()
        residual[token] = 0
        if float(residual.sum()) <= 0:  # p(d) is 1 up to rounding: nothing else is possible
            out.append(int(token))
            continue
        out.append(_race(residual, generator))
        return out
    out.append(_race(probs[len(draft)], generator))
    return out
