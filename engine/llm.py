"""The offline Python entry, shaped like vLLM's `LLM` so users know it."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from preheat.engine.config import EngineConfig
from preheat.engine.engine import Engine
from preheat.engine.request.sampling_params import SamplingParams
from preheat.engine.request.sequence import RequestOutput, TokenLogprob


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str | None
    cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # with finish_reason "error": what failed (the others still ran)

    @property
    def outputs(self) -> list[GenerationResult]:  # vLLM's RequestOutput.outputs[0] habit
        return [self]


# vLLM's `speculative_config` keys -> our settings (the same names as flat keyword arguments).
_SPECULATIVE_KEYS = {
    "method": "speculative_method",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_max": "prompt_lookup_max",
    "prompt_lookup_min": "prompt_lookup_min",
}


def speculative_settings(speculative_config: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's `LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4})` as EngineConfig fields; unknown keys are refused."""
    if not speculative_config:
        return {}
    unknown = sorted(set(speculative_config) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unsupported key(s) {', '.join(unknown)}; "
                         f"supported: {', '.join(_SPECULATIVE_KEYS)}")
    return {_SPECULATIVE_KEYS[k]: v for k, v in speculative_config.items()}


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        page_size: int = 16,
        speculative_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.update(speculative_settings(speculative_config))
        self.engine = Engine(EngineConfig(model=model, dtype=dtype, page_size=page_size, **kwargs))
        if self.engine.weight_move is not None:
            self.engine.weight_move.start()  # in the background; a later step swaps it in

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def close(self) -> None:
        """Stops the tensor-parallel workers (`tensor_parallel_size` > 1); they also stop when
        this process exits."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """One result per prompt, in order. A single string or a single list of token ids
        counts as one prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError("give one SamplingParams, or one per prompt")
        # Validate every prompt before queueing any: a refused batch leaves nothing running.
        seqs = [self.engine.build_sequence(p, sp) for p, sp in zip(prompts, params_list)]
        ids = [self.engine.enqueue(seq) for seq in seqs]
        finals: dict[str, RequestOutput] = {}
        while len(finals) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
        return [
            GenerationResult(
                prompt_token_ids=finals[i].prompt_token_ids,
                token_ids=finals[i].token_ids,
                text=finals[i].text,
                finish_reason=finals[i].finish_reason,
                cached_tokens=finals[i].cached_tokens,
                logprobs=finals[i].logprobs,
                error=finals[i].error,
            )
            for i in ids
        ]
