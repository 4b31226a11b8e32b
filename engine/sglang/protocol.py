"""Request bodies of SGLang's native API (`POST /generate`), as pydantic models.

Field names and meanings are SGLang's (`GenerateReqInput` in sglang/srt/managers/io_struct.py,
`SamplingParams` in sglang/srt/sampling/sampling_params.py). Ranges and list lengths are
engine/request/limits.py's, the same the OpenAI routes enforce. A field SGLang knows but
Preheat cannot honour passes validation here only at its "asks for nothing" value (None,
false, empty, SGLang's default); any other value, and any name SGLang does not know, is
refused by engine/sglang/params.py with a 400 that names it, never ignored.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from preheat.engine.request.limits import (
    LOGIT_BIAS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS_LIST,
    MAX_TOP_LOGPROBS,
    SAMPLING_BOUNDS,
    TOKEN_ID,
)

TokenId = Annotated[int, Field(**TOKEN_ID.constraints())]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_TOKENS_LIST)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]

# SGLang's max_new_tokens counts from 0: 0 computes (and caches) the prompt only.
MAX_NEW_TOKENS_LE = SAMPLING_BOUNDS["max_tokens"].hi


def _bounded(name: str, default: Any = None) -> Any:
    # mypy cannot match a dict of keyword arguments to Field's overloads.
    return Field(default=default, **SAMPLING_BOUNDS[name].constraints())  # type: ignore[call-overload]


class _Body(BaseModel):
    # Names outside the model are kept (extra="allow") so engine/sglang/params.py can refuse
    # each by name, or accept it where its value asks for nothing.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class SGLangSamplingParams(_Body):
    """`sampling_params` of /generate. None means SGLang's default, as SGLang reads it."""

    max_new_tokens: int | None = Field(default=128, ge=0, le=MAX_NEW_TOKENS_LE)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    temperature: float | None = _bounded("temperature")
    top_p: float | None = _bounded("top_p")
    top_k: int | None = _bounded("top_k")  # -1 (SGLang's "off"); 0 is off too
    min_p: float | None = _bounded("min_p")
    frequency_penalty: float | None = _bounded("frequency_penalty")
    presence_penalty: float | None = _bounded("presence_penalty")
    repetition_penalty: float | None = _bounded("repetition_penalty")
    ignore_eos: bool | None = False
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None  # SGLang sends a JSON string
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    sampling_seed: int | None = _bounded("seed")
    logit_bias: Annotated[dict[str, Annotated[float, Field(**LOGIT_BIAS.constraints())]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    no_stop_trim: bool | None = False  # true: the stop string stays in the text
    # What the frontend always sends, honoured at these values only.
    min_new_tokens: int | None = 0
    stop_regex: str | list[str] | None = None
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True


PerPrompt = Annotated[list[Any], Field(max_length=MAX_PROMPTS)]


class GenerateRequest(_Body):
    """`POST /generate`: one prompt or a batch, as text or token ids."""

    text: str | Annotated[list[str], Field(max_length=MAX_PROMPTS)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS)] | None = None
    sampling_params: SGLangSamplingParams | Annotated[list[SGLangSamplingParams],
                                                      Field(max_length=MAX_PROMPTS)] | None = None
    rid: str | Annotated[list[str], Field(max_length=MAX_PROMPTS)] | None = None
    return_logprob: bool | Annotated[list[bool], Field(max_length=MAX_PROMPTS)] | None = None
    # -1: output tokens only (SGLang's default); k: also the prompt tokens from position k.
    logprob_start_len: int | Annotated[list[int], Field(max_length=MAX_PROMPTS)] | None = None
    top_logprobs_num: (Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
                       | Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]],
                                   Field(max_length=MAX_PROMPTS)] | None) = None
    return_text_in_logprobs: bool = False
    stream: bool = False
