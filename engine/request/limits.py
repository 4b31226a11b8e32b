"""Every bound on a request, in one place.

The HTTP layer (engine/api/openai_protocol.py) turns these into pydantic constraints, so a bad
value is a 400 naming its field before anything else runs (and the OpenAPI document at
/openapi.json shows the ranges); `SamplingParams.validate` checks the same `Bound`s for the
Python API. A range is written here once and read by both, never restated.

Checks that need the model or the tokenizer (prompt length against the context, token ids
against the vocabulary, grammar size and compile time, the per-request prompt-token budget)
live in the engine (engine/request/builder.py, engine/sample/structured.py) and raise
`RequestRejected`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from preheat.engine.request.errors import RequestRejected

MAX_INT32 = 2**31 - 1

# A temperature below this is greedy decoding (vLLM uses the same floor): dividing logits by
# 1e-45 overflows float32 to inf, and the "sample" is noise instead of the likeliest token.
GREEDY_TEMPERATURE = 1e-5

# Lists a request may carry. Each one costs the server work before any check that needs the
# model, so each is bounded here (the body size alone, 4 MiB, allows ~500,000 of them).
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 256  # prompts of one completions request
MAX_SEQUENCES_PER_REQUEST = 256  # prompts x n: engine requests one HTTP request may add
MAX_MESSAGES = 1024  # chat messages
MAX_CONTENT_PARTS = 256  # text parts of one message
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 256  # characters of one stop string (held back from streams until ruled out)
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's API
MAX_TOP_LOGPROBS = 20
MAX_TOKENS_LIST = 1_000_000  # token ids of one /detokenize request or one prompt given as ids
# A regex or JSON schema longer than this (in characters, the schema as compact JSON) is
# refused before compiling: the compile-time limit (--grammar-compile-timeout) bounds the
# rest, since short regexes like `.{0,1000}x` can take seconds too.
MAX_GRAMMAR_CHARS = 64 * 1024


@dataclass(frozen=True)
class Bound:
    """A closed range [lo, hi] (open at lo when `lo_open`). NaN and infinities are never in
    range, so a float field bounded here is always finite."""

    lo: float
    hi: float
    lo_open: bool = False

    def contains(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        return above and value <= self.hi

    def describe(self) -> str:
        return f"{'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}]"

    def constraints(self) -> dict[str, float]:
        """Keyword arguments of pydantic's Field for this range."""
        low = {"gt": self.lo} if self.lo_open else {"ge": self.lo}
        return {**low, "le": self.hi}

    def check(self, param: str, value: Any) -> None:
        if not self.contains(value):
            raise RequestRejected("invalid_value", param, f"{param} must be in {self.describe()}, got {value!r}")


def _num(x: float) -> str:
    if isinstance(x, int) and abs(x) >= 2**31 - 1:
        return f"{'-' if x < 0 else ''}2^{round(math.log2(abs(x) + 1))}{'' if x < 0 else '-1'}"
    return f"{x:g}" if isinstance(x, float) else str(x)


# The sampling fields and their ranges (the names are the OpenAI / vLLM field names).
SAMPLING_BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(1, MAX_INT32),
    # [0, 100]: 0 (or anything below GREEDY_TEMPERATURE) is greedy; above ~5 the output is
    # noise already, 100 keeps the division finite.
    "temperature": Bound(0.0, 100.0),
    "top_p": Bound(0.0, 1.0, lo_open=True),
    # -1 and 0 turn top-k off; a k at or above the vocabulary size keeps every token.
    "top_k": Bound(-1, MAX_INT32),
    "min_p": Bound(0.0, 1.0),
    # A penalty divides (or multiplies) logits: 1e-300 would turn them into inf and NaN.
    "repetition_penalty": Bound(0.01, 100.0),
    "frequency_penalty": Bound(-2.0, 2.0),
    "presence_penalty": Bound(-2.0, 2.0),
    "logprobs": Bound(0, MAX_TOP_LOGPROBS),
    # A seed is a 64-bit integer; n choices use seed, seed + 1, ... (a torch generator takes
    # any value in [-2^63, 2^64)).
    "seed": Bound(-(2**63), 2**63 - 1),
}

TOKEN_ID = Bound(0, MAX_INT32)  # any token id before the vocabulary is known
LOGIT_BIAS = Bound(-100.0, 100.0)
