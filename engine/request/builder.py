"""From a prompt and sampling parameters to a `Sequence` the engine can run, or a
`RequestRejected` (a ValueError with a code and the parameter at fault) that says why it
cannot run: too long for the context or the pool, tokens outside the vocabulary, a grammar
that is too large, does not compile or takes too long to. Checked before anything is
queued, so a bad request is refused at the API and never reaches the step loop.

These are the checks that need the model or the tokenizer; ranges that do not are
engine/request/limits.py's. `build` runs in the caller's thread (the server calls it from a
worker thread, never on the event loop: tokenizing and compiling a grammar take time)."""

from __future__ import annotations

import itertools
import threading
import uuid
from typing import Any

import torch

from preheat.engine.request.detokenizer import IncrementalDetokenizer
from preheat.engine.request.errors import RequestRejected
from preheat.engine.request.sampling_params import SamplingParams
from preheat.engine.request.sequence import Sequence


def default_stop_ids(tokenizer: Any, hf_config: Any) -> set[int]:
    """The model's end-of-sequence ids: the tokenizer's EOS plus the config's (one or many)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return ids


class RequestBuilder:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        pool_pages: int,
        page_size: int,
        stop_token_ids: set[int],
        grammar_backend: Any,
        device: torch.device,
        seed: int,
        max_request_prompt_tokens: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.pool_pages = pool_pages
        self.page_size = page_size
        self.stop_token_ids = stop_token_ids
        self.grammar_backend = grammar_backend
        self.device = device
        self.max_request_prompt_tokens = max_request_prompt_tokens
        self._rng = torch.Generator().manual_seed(seed)  # seeds for requests that bring none
        self._rng_lock = threading.Lock()  # build() runs in several threads at once
        self._ids = itertools.count()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return [int(t) for t in prompt]

    def check_request_budget(self, prompt_tokens: int, param: str = "prompt") -> None:
        """One HTTP request may add several sequences (prompts x n); together their prompt
        tokens must stay within `--max-request-prompt-tokens`."""
        limit = self.max_request_prompt_tokens
        if limit is not None and prompt_tokens > limit:
            raise RequestRejected(
                "request_too_large", param,
                f"the request has {prompt_tokens} prompt tokens across its prompts and choices; "
                f"one request may have at most {limit} (--max-request-prompt-tokens)",
            )

    def build(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> Sequence:
        params = params or SamplingParams()
        params.validate()
        token_ids = self.encode(prompt)
        if not token_ids:
            raise RequestRejected("invalid_value", "prompt", "the prompt is empty")
        vocab = self.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise RequestRejected("invalid_value", "prompt", f"prompt token ids must be in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestRejected(
                "invalid_value", "logit_bias",
                f"logit_bias: token id {max(params.logit_bias)} is not in the vocabulary [0, {vocab})",
            )
        n = len(token_ids)
        # A prompt-only request generates nothing: its prompt alone must fit.
        max_tokens = 0 if params.prompt_only else params.max_tokens
        if n > self.max_model_len or (n == self.max_model_len and not params.prompt_only):
            raise RequestRejected(
                "context_length_exceeded", "prompt",
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{n} tokens and leaves no room to generate; shorten the prompt",
            )
        if max_tokens is not None and n + max_tokens > self.max_model_len:
            raise RequestRejected(
                "context_length_exceeded", "max_tokens",
                f"max_tokens is too large: {params.max_tokens} + {n} prompt tokens exceeds the "
                f"context length of {self.max_model_len} tokens",
            )
        limit = n + max_tokens if max_tokens is not None else self.max_model_len
        capacity = self.pool_pages * self.page_size
        if limit > capacity:  # = more pages than the pool has, page rounding included
            raise RequestRejected(
                "request_too_large", "max_tokens",
                f"the request needs up to {limit} tokens of KV but the pool holds {capacity}",
            )
        matcher = None
        if params.structured is not None and not params.prompt_only:
            if self.grammar_backend is None:
                raise RequestRejected("unsupported", None, "structured output is not available in this build")
            compiled = self.grammar_backend.compile(params.structured)  # raises RequestRejected
            matcher = self.grammar_backend.new_matcher(compiled)
        if params.seed is not None:
            seed = params.seed
        else:
            with self._rng_lock:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        generator = torch.Generator(device=self.device).manual_seed(seed)
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids |= self.stop_token_ids
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        return Sequence(
            request_id,
            token_ids,
            params,
            generator,
            IncrementalDetokenizer(self.tokenizer, list(params.stop or []), params.include_stop_str_in_output),
            stop_ids,
            limit,
            matcher,
        )

