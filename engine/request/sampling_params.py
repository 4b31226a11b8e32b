"""Per-request sampling settings, shaped like vLLM's so users know them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from preheat.engine.request.errors import RequestRejected
from preheat.engine.request.limits import (
    GREEDY_TEMPERATURE,
    LOGIT_BIAS,
    MAX_LOGIT_BIAS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    SAMPLING_BOUNDS,
    TOKEN_ID,
)

STRUCTURED_KINDS = ("regex", "json_schema", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text. `spec` is the regex, the JSON schema (a JSON
    string or a dict), None for `json_object` (any JSON object), or an xgrammar structural
    tag (a JSON string or a dict; tool calls, see engine/tools/calling.py)."""

    kind: str
    spec: Any = None

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}")


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: plus the top k
    structured: StructuredOutput | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # Compute the prompt (so it is cached, and its logprobs) and generate nothing: SGLang's
    # max_new_tokens=0. max_tokens is then not used.
    prompt_only: bool = False
    # Logprobs of the prompt's own tokens (SGLang's logprob_start_len, vLLM's prompt_logprobs):
    # None: none; 0: each prompt token's; k: plus the top k at each position. They cover the
    # prompt tokens from position prompt_logprobs_start on; the prefix cache serves at most
    # that many tokens, so every position asked for is computed.
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, OverflowError):
                raise RequestRejected("invalid_value", "logit_bias", "logit_bias must map token ids to numbers") from None
        else:
            self.logit_bias = None
        self.validate()

    def validate(self) -> None:
        """Raises RequestRejected (a ValueError) naming the field out of range. The ranges are
        engine/request/limits.py's, the same the HTTP layer enforces."""
        for name, bound in SAMPLING_BOUNDS.items():
            value = getattr(self, name)
            if value is not None:
                bound.check(name, value)
        if self.prompt_logprobs is not None:
            SAMPLING_BOUNDS["logprobs"].check("prompt_logprobs", self.prompt_logprobs)
            TOKEN_ID.check("prompt_logprobs_start", self.prompt_logprobs_start)
        if len(self.stop) > MAX_STOP:
            raise RequestRejected("invalid_value", "stop", f"stop: at most {MAX_STOP} sequences")
        for s in self.stop:
            if len(s) > MAX_STOP_CHARS:
                raise RequestRejected("invalid_value", "stop", f"stop: a sequence may have at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestRejected("invalid_value", "stop_token_ids", f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids")
        for token in self.stop_token_ids:
            TOKEN_ID.check("stop_token_ids", token)
        if self.logit_bias and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestRejected("invalid_value", "logit_bias", f"logit_bias: at most {MAX_LOGIT_BIAS} entries")
        for token, bias in (self.logit_bias or {}).items():
            if not TOKEN_ID.contains(token):
                raise RequestRejected("invalid_value", "logit_bias", f"logit_bias: {token!r} is not a token id")
            if not LOGIT_BIAS.contains(bias):
                raise RequestRejected(
                    "invalid_value", "logit_bias", f"logit_bias: the bias for token {token} must be in [-100, 100]"
                )

    @property
    def greedy(self) -> bool:
        """Temperature 0, or so close to it that dividing by it would overflow."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )
