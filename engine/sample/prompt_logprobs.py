"""Logprobs of a request's own prompt tokens (SamplingParams.prompt_logprobs).

The hidden state at prompt position p gives the model's distribution over the token at
p + 1, so the logprob of prompt token p + 1 comes from the row of p in the extend pass that
computes it. Positions the prefix cache served are not computed; the engine keeps the cache
from serving the positions a request asks about (Sequence.max_cached_prefix). A long prompt
computed in chunks fills its entries chunk by chunk; a preempted one that recomputes simply
writes the same entries again.

These are the model's own probabilities (log-softmax of the logits, no temperature, penalty
or grammar), which is what SGLang's frontend scores `select()` choices with.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from preheat.engine.request.sequence import Sequence, TokenLogprob

# Rows turned into vocabulary-sized logits at once: bounds the memory a long prompt with
# logprobs from position 0 takes (rows x vocab floats).
ROWS_PER_SLICE = 128


@dataclass(frozen=True)
class PromptRow:
    seq: Sequence
    row: int  # row in the forward pass's hidden states
    index: int  # entry in seq.prompt_logprobs
    target: int  # the prompt token whose logprob this row gives


def prompt_rows(entries: Seq[Any]) -> list[PromptRow]:
    """The rows of a forward pass (entries in its order: decodes, then extends) that give
    a prompt logprob some request asked for."""
    out: list[PromptRow] = []
    offset = 0
    for entry in entries:
        seq = entry.seq
        if seq.prompt_logprobs is not None and not entry.draft:
            prompt = seq.prompt_token_ids
            start = seq.params.prompt_logprobs_start
            first = max(entry.start, start)
            end = min(entry.start + entry.length, len(prompt) - 1)
            for p in range(first, end):
                out.append(PromptRow(seq, offset + p - entry.start, p + 1 - start, prompt[p + 1]))
        offset += entry.length
    return out


@torch.inference_mode()
def record_prompt_logprobs(model: Any, hidden: torch.Tensor, rows: list[PromptRow]) -> None:
    """Writes each row's logprob (and the top k the request asked for) into its sequence."""
    for lo in range(0, len(rows), ROWS_PER_SLICE):
        part = rows[lo : lo + ROWS_PER_SLICE]
        index = torch.tensor([r.row for r in part], device=hidden.device)
        logprobs = torch.log_softmax(model.logits(hidden[index]).float(), dim=-1)
        targets = torch.tensor([r.target for r in part], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        k = max(r.seq.params.prompt_logprobs or 0 for r in part)
        top_v, top_i = (logprobs.topk(k, dim=-1) if k else (None, None))
        top_vals = top_v.tolist() if top_v is not None else None
        top_ids = top_i.tolist() if top_i is not None else None
        for j, r in enumerate(part):
            want = r.seq.params.prompt_logprobs or 0
            top = list(zip(top_ids[j][:want], top_vals[j][:want])) if want and top_ids else []
            r.seq.prompt_logprobs[r.index] = TokenLogprob(r.target, float(chosen[j]), top)  # type: ignore[index]
