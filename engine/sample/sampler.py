"""Batched sampling: penalties, logit bias, grammar masks, temperature, top-k/top-p/min-p,
seeds.

All rows are processed together as tensors; the only per-row work is drawing each row's
noise from its own generator, which is what makes a seeded request reproducible whatever
else shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from preheat.engine.request.sampling_params import SamplingParams
from preheat.engine.sample import spec_decode


class SamplingRow(Protocol):
    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    matcher: Any  # grammar matcher or None


def default_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: torch's (a kernel backend passes its own, see KernelBackend.argmax)."""
    return x.argmax(-1)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # chosen token's logprob per row, when any row asked
    top_logprobs: list[list[tuple[int, float]]] | None
    # Rows whose sampling raised (engine/runner.py samples them one by one to find out);
    # their token id is -1 and their request is failed.
    failed: dict[int, BaseException] = field(default_factory=dict)


def _padded(rows: Sequence[list[int]], fill: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    out = torch.full((len(rows), width), fill, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place. Repetition penalty (HF style, over prompt and output) and OpenAI-style
    frequency/presence penalties (over output)."""
    batch, vocab = logits.shape
    device = logits.device
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device, dtype=logits.dtype)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device, dtype=logits.dtype)
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=device, dtype=logits.dtype)
    out_ids = _padded([r.output_token_ids for r in rows], vocab, device)
    counts = torch.zeros((batch, vocab + 1), device=device, dtype=logits.dtype)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    if bool((rep != 1.0).any()):
        seen_ids = _padded([r.prompt_token_ids + r.output_token_ids for r in rows], vocab, device)
        seen = torch.zeros((batch, vocab + 1), device=device, dtype=torch.bool)
        seen.scatter_(1, seen_ids, True)
        seen = seen[:, :vocab]
        penalised = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
        logits.copy_(torch.where(seen, penalised, logits))
    logits -= freq[:, None] * counts + pres[:, None] * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: each row's bias added to its tokens' logits (OpenAI `logit_bias`)."""
    row_idx: list[int] = []
    token_idx: list[int] = []
    values: list[float] = []
    for i, r in enumerate(rows):
        for token, bias in (r.params.logit_bias or {}).items():
            row_idx.append(i)
            token_idx.append(token)
            values.append(bias)
    device = logits.device
    logits.index_put_(
        (torch.tensor(row_idx, device=device), torch.tensor(token_idx, device=device)),
        torch.tensor(values, device=device, dtype=logits.dtype),
        accumulate=True,
    )


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-k / nucleus / min-p set."""
    vocab = logits.shape[1]
    neg_inf = torch.finfo(logits.dtype).min
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    if bool((k < vocab).any()):
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, neg_inf)
    if bool((top_p < 1).any()):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly above each token
        drop_sorted = before > top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, neg_inf)
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, neg_inf)
    return logits


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow], grammar_masks=None) -> None:
    """In place: penalties, logit bias, then grammar masks (which have the last word)."""
    params = [r.params for r in rows]
    if any(p.needs_penalties for p in params):
        apply_penalties(logits, rows)
    if any(p.logit_bias for p in params):
        apply_logit_bias(logits, rows)
    if grammar_masks is not None and any(r.matcher is not None for r in rows):
        grammar_masks(logits, [r.matcher for r in rows])


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: temperature (greedy rows get 1), then
    top-k / top-p / min-p, then softmax."""
    device = logits.device
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
    scaled = logits / temps[:, None]
    scaled = apply_top_k_top_p_min_p(
        scaled,
        torch.tensor([p.top_k for p in params], device=device),
        torch.tensor([p.top_p for p in params], device=device, dtype=scaled.dtype),
        torch.tensor([p.min_p for p in params], device=device, dtype=scaled.dtype),
    )
    return scaled.softmax(-1)


def _top_logprobs(
    logprobs_all: torch.Tensor, params: Sequence[SamplingParams]
) -> list[list[tuple[int, float]]]:
    max_top = max((p.logprobs or 0) for p in params)
    tops: list[list[tuple[int, float]]] = [[] for _ in params]
    if max_top > 0:
        values, indices = logprobs_all.topk(max_top, dim=-1)
        values_l, indices_l = values.tolist(), indices.tolist()
        for i, p in enumerate(params):
            k = p.logprobs or 0
            tops[i] = list(zip(indices_l[i][:k], values_l[i][:k]))
    return tops


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], grammar_masks=None,
           argmax: Callable[[torch.Tensor], torch.Tensor] = default_argmax) -> SampleResult:  # fmt: skip
    """logits [B, V] float32 (modified in place) -> one token per row. `argmax`: each row's
    argmax as torch.argmax(x, -1) gives it (the kernel backend's, which is faster on the CPU)."""
    device = logits.device
    params = [r.params for r in rows]
    process_logits(logits, rows, grammar_masks)

    want_logprobs = any(p.logprobs is not None for p in params)
    logprobs_all = logits.log_softmax(-1) if want_logprobs else None

    chosen = argmax(logits)
    if not all(p.greedy for p in params):
        greedy = torch.tensor([p.greedy for p in params], device=device)
        probs = target_probs(logits, params)
        # Exponential race (equivalent to sampling from probs): argmax(p / E), E ~ Exp(1),
        # each row's E drawn from its own generator.
        noise = torch.empty_like(probs)
        for i, row in enumerate(rows):
            if not params[i].greedy:
                noise[i].exponential_(generator=row.generator)
            else:
                noise[i].fill_(1.0)
        sampled = argmax(probs / noise)
        chosen = torch.where(greedy, chosen, sampled)

    token_ids = chosen.tolist()
    if logprobs_all is None:
        return SampleResult(token_ids, None, None)
    chosen_lp = logprobs_all.gather(1, chosen[:, None]).squeeze(1).tolist()
    return SampleResult(token_ids, chosen_lp, _top_logprobs(logprobs_all, params))


@dataclass
class DraftPosition:
    """One position of a sequence whose draft is being verified: the sampler sees the
    sequence as if the draft's first tokens were already output (penalties count them)."""

    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    matcher: Any = None


def verify_drafts(
    logits: torch.Tensor, rows: Sequence[SamplingRow], drafts: Sequence[Sequence[int]], draft_grammar_masks=None,
    argmax: Callable[[torch.Tensor], torch.Tensor] = default_argmax,
) -> list[SampleResult]:
    """logits [sum(len(d) + 1), V] float32 (modified in place): for each sequence, the rows
    after its last known token and after each draft token, back to back. Every row is
    processed as decoding would process it at that position (penalties over the output plus
    the draft so far, logit bias, the grammar advanced through the draft), then the draft is
    accepted or rejected (engine/sample/spec_decode.py). Returns, per sequence, the tokens this step
    yields (at least one) with their logprobs when asked."""
    positions: list[DraftPosition] = []
    starts: list[int] = []
    for row, draft in zip(rows, drafts):
        starts.append(len(positions))
        for i in range(len(draft) + 1):
            output = row.output_token_ids + list(draft[:i]) if i else row.output_token_ids
            positions.append(DraftPosition(row.params, row.generator, row.prompt_token_ids, output))
    process_logits(logits, positions)
    if draft_grammar_masks is not None and any(r.matcher is not None for r in rows):
        draft_grammar_masks(logits, [(s, r.matcher, d) for s, r, d in zip(starts, rows, drafts)])

    params = [p.params for p in positions]
    logprobs_all = logits.log_softmax(-1) if any(p.logprobs is not None for p in params) else None
    best = argmax(logits).tolist()
    probs = None if all(p.greedy for p in params) else target_probs(logits, params)

    results = []
    for row, draft, start in zip(rows, drafts, starts):
        end = start + len(draft) + 1
        if row.params.greedy:
            tokens = spec_decode.accept_greedy(best[start:end], draft)
        else:
            assert probs is not None
            tokens = spec_decode.accept_sampled(probs[start:end], draft, row.generator)
        if logprobs_all is None or row.params.logprobs is None:
            results.append(SampleResult(tokens, None, None))
            continue
        used = logprobs_all[start : start + len(tokens)]
        chosen = used.gather(1, torch.tensor(tokens, device=used.device)[:, None]).squeeze(1).tolist()
        results.append(SampleResult(tokens, chosen, _top_logprobs(used, [row.params] * len(tokens))))
    return results
