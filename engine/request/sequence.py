"""A request inside the engine: its tokens, its KV pages, its progress and its output."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from preheat.engine.request.detokenizer import IncrementalDetokenizer
from preheat.engine.request.sampling_params import SamplingParams

if TYPE_CHECKING:  # annotations only: the HTTP server imports this module before it listens
    import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    new_text: str
    finished: bool
    finish_reason: str | None
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # set with finish_reason "error": what failed, for the client
    # SamplingParams.prompt_logprobs: one entry per prompt token from prompt_logprobs_start
    # on, None for a token nothing predicts (the first one asked for has no context in the
    # request's terms, as SGLang answers). Complete once the prompt is computed.
    prompt_logprobs: list[TokenLogprob | None] | None = None


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator,
        detokenizer: IncrementalDetokenizer,
        stop_token_ids: set[int],
        max_total_tokens: int,
        matcher: Any = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        self.generator = generator
        self.detokenizer = detokenizer
        self.stop_token_ids = stop_token_ids
        self.max_total_tokens = max_total_tokens  # prompt + output may not exceed this
        self.matcher = matcher
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        # KV state: pages[:num_shared] belong to the radix tree (locked through `node`).
        self.pages: list[int] = []
        self.num_shared = 0
        self.node: Any = None
        self.num_computed = 0
        self.cached_tokens: int | None = None  # prompt tokens served from cache, first admission
        # L3 loads started for it while it waits (engine/kv/cache_manager.py prefetch_pending):
        # None = not looked at yet, False = nothing to wait for.
        self.prefetch: Any = None
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        if params.prompt_logprobs is not None:
            start = min(params.prompt_logprobs_start, len(prompt_token_ids))
            self.prompt_logprobs = [None] * (len(prompt_token_ids) - start)
        self.emitted_tokens = 0
        self.emitted_logprobs = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list (a decode
        step needs one token of each sequence; all_token_ids copies its whole context)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def max_cached_prefix(self) -> int:
        """Most tokens the prefix cache may serve: all but the last known one (its logits give
        the next token), and no further than the first prompt position whose logprob is
        asked for (cached positions are not computed, so they give no logprobs)."""
        limit = self.num_tokens - 1
        if self.prompt_logprobs is not None:
            limit = min(limit, self.params.prompt_logprobs_start)
        return max(0, limit)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def error_output(self, message: str) -> RequestOutput:
        """The last output of a request that failed; built without the detokenizer (it may be
        what failed)."""
        self.finish_reason = "error"
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.output_token_ids),
            new_token_ids=[],
            text=self.detokenizer.text,
            new_text="",
            finished=True,
            finish_reason="error",
            cached_tokens=self.cached_tokens or 0,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            new_logprobs=[] if self.logprobs is not None else None,
            error=message,
            prompt_logprobs=self.prompt_logprobs,
        )

    def take_output(self) -> RequestOutput:
        """What this request has produced, with what is new since the last call."""
        new_ids = self.output_token_ids[self.emitted_tokens :]
        self.emitted_tokens = len(self.output_token_ids)
        new_lps = None
        if self.logprobs is not None:
            new_lps = self.logprobs[self.emitted_logprobs :]
            self.emitted_logprobs = len(self.logprobs)
        new_text = self.detokenizer.take_new_text(self.finished)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.output_token_ids),
            new_token_ids=new_ids,
            text=self.detokenizer.text if self.finished else self.detokenizer.text[: self.detokenizer.emitted],
            new_text=new_text,
            finished=self.finished,
            finish_reason=self.finish_reason,
            cached_tokens=self.cached_tokens or 0,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            new_logprobs=new_lps,
            prompt_logprobs=self.prompt_logprobs,
        )
