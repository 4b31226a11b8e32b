"""From a prompt and sampling parameters to a `Sequence` the engine can run, or a ValueError
that says why it cannot run (too long for the context or the pool, tokens outside the
vocabulary, a grammar that does not compile). Checked before anything is queued, so a bad
request is refused at the API and never reaches the step loop."""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import torch

from preheat.engine.detokenizer import IncrementalDetokenizer
from preheat.engine.sampling_params import SamplingParams
from preheat.engine.scheduler import pages_for
from preheat.engine.sequence import Sequence


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
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.pool_pages = pool_pages
        self.page_size = page_size
        self.stop_token_ids = stop_token_ids
        self.grammar_backend = grammar_backend
        self.device = device
        self._rng = torch.Generator().manual_seed(seed)  # seeds for requests that bring none
        self._ids = itertools.count()

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return [int(t) for t in prompt]

    def build(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> Sequence:
        params = params or SamplingParams()
        params.validate()
        token_ids = self.encode(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} is not in the vocabulary [0, {vocab})")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but the context length is {self.max_model_len}; "
                "shorten the prompt"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens {params.max_tokens} plus the prompt's {n} tokens exceeds the "
                f"context length {self.max_model_len}"
            )
        limit = n + params.max_tokens if params.max_tokens is not None else self.max_model_len
        capacity = self.pool_pages * self.page_size
        if pages_for(limit, self.page_size) > self.pool_pages:
            raise ValueError(f"the request needs up to {limit} tokens of KV but the pool holds {capacity}")
        matcher = None
        if params.structured is not None:
            if self.grammar_backend is None:
                raise ValueError("structured output is not available in this build")
            compiled = self.grammar_backend.compile(params.structured)
            matcher = self.grammar_backend.new_matcher(compiled)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
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
