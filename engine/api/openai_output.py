"""Engine outputs as pieces of OpenAI responses (pure): usage, and logprobs in the chat and
the completion shapes. Decoding a token per logprob entry is real work for long answers:
the serving layer calls these off the event loop for whole answers.
"""

from __future__ import annotations

from typing import Any

from preheat.engine.engine_client import Tokenizer
from preheat.engine.request.sequence import RequestOutput, TokenLogprob


def usage(prompts: list[list[int]], finals: list[RequestOutput], n: int) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(o.token_ids or ()) for o in finals)
    # Each prompt is billed once however many choices it has; its cached part is what its
    # first choice found in the prefix cache.
    cached = sum(int(finals[i * n].cached_tokens or 0) for i in range(len(prompts)))
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": min(cached, prompt_tokens)},
    }


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _top_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = _token_text(tokenizer, token_id)
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def _logprobs(out: RequestOutput, new_only: bool) -> list[TokenLogprob]:
    if new_only:
        return list(getattr(out, "new_logprobs", None) or [])
    return list(out.logprobs or [])


def chat_logprobs(tokenizer: Tokenizer, out: RequestOutput, new_only: bool = False) -> dict[str, Any]:
    """`choices[].logprobs` of a chat answer (`new_only`: this step's tokens, for a chunk)."""
    content = []
    for lp in _logprobs(out, new_only):
        entry = _top_entry(tokenizer, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_top_entry(tokenizer, t, v) for t, v in (lp.top or [])]
        content.append(entry)
    return {"content": content}


def completion_logprobs(tokenizer: Tokenizer, out: RequestOutput, offset: int,
                        new_only: bool = False) -> dict[str, Any]:
    """`choices[].logprobs` of a completion; `offset`: where the text starts in the choice
    (after an echoed prompt, or what earlier chunks sent)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for lp in _logprobs(out, new_only):
        text = _token_text(tokenizer, lp.token_id)
        tokens.append(text)
        token_lps.append(float(lp.logprob))
        tops.append({_token_text(tokenizer, t): float(v) for t, v in (lp.top or [])})
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}
