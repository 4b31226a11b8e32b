"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests validate ranges here so a bad value is a 400 naming the parameter; unknown fields
are ignored, as OpenAI-compatible servers do, so newer SDKs keep working. Every range and
list length comes from engine/request/limits.py (the one home of request bounds); the
models are also the request schemas of /openapi.json.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from preheat.engine.request.limits import (
    LOGIT_BIAS,
    MAX_CONTENT_PARTS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_SEQUENCES_PER_REQUEST,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS_LIST,
    SAMPLING_BOUNDS,
    TOKEN_ID,
)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def invalid(param: str, message: str) -> PydanticCustomError:
    """A whole-request check's error: the server reports `param` from the error's context,
    never by reading the message."""
    return PydanticCustomError("invalid_value", "{message}", {"param": param, "message": message})


def _bounded(name: str, default: Any = None) -> Any:
    # mypy cannot match a dict of keyword arguments to Field's overloads.
    return Field(default=default, **SAMPLING_BOUNDS[name].constraints())  # type: ignore[call-overload]


TokenId = Annotated[int, Field(**TOKEN_ID.constraints())]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_TOKENS_LIST)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
LogitBias = Annotated[float, Field(**LOGIT_BIAS.constraints())]


# ---------------------------------------------------------------- requests


class _Request(BaseModel):
    # NaN and infinities (Python's JSON reader accepts them) are never a valid number here.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Request):
    name: str
    arguments: str = ""  # JSON text, as the API returned it


class ToolCall(_Request):
    """A call an assistant made earlier in the conversation, sent back as history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this result answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def as_dict(self) -> dict[str, Any]:
        """The message as engine/api/chat_render.py takes it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _message_problem(messages: list[ChatMessage]) -> tuple[str, str] | None:
    """Tool turns must be shaped as OpenAI requires: calls only from the assistant, and each
    tool result naming the call it answers. (param, message) or None."""
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            p = f"messages.{i}.tool_calls"
            return p, f"{p}: only assistant messages carry tool_calls"
        if m.role == "tool" and not m.tool_call_id:
            p = f"messages.{i}.tool_call_id"
            return p, f"{p}: a tool message needs the id of the call it answers"
    return None


def _tools_problem(tools: Any, tool_choice: Any) -> tuple[str, str] | None:
    """The first problem with `tools` / `tool_choice`, as (param, message), or None."""
    from preheat.engine.tools.calling import tool_choice_problem, tool_problems

    problems = tool_problems(tools) if tools is not None else []
    problem = problems[0] if problems else None
    if problem is None:
        names = [t["function"]["name"] for t in tools or ()]
        problem = tool_choice_problem(tool_choice, names)
    return (problem[0], "{}: {}".format(*problem)) if problem else None


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise invalid("response_format", "response_format of type json_schema needs a json_schema object")
        return self


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    model: str | None = None
    max_tokens: int | None = _bounded("max_tokens")
    temperature: float | None = _bounded("temperature")
    top_p: float | None = _bounded("top_p")
    top_k: int | None = _bounded("top_k")  # 0 and -1 both mean off
    min_p: float | None = _bounded("min_p")
    seed: int | None = _bounded("seed")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    frequency_penalty: float = _bounded("frequency_penalty", 0.0)
    presence_penalty: float = _bounded("presence_penalty", 0.0)
    repetition_penalty: float = _bounded("repetition_penalty", 1.0)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    regex: str | None = None  # SGLang's extra body field; its size is bounded where it compiles
    user: str | None = None
    # OpenAI sends token ids as JSON object keys, i.e. strings.
    logit_bias: Annotated[dict[str, LogitBias], Field(max_length=MAX_LOGIT_BIAS)] | None = None

    @model_validator(mode="after")
    def _logit_bias_keys_are_token_ids(self) -> SamplingFields:
        for key in self.logit_bias or {}:
            digits = key.strip()
            if not (digits.isascii() and digits.isdigit() and TOKEN_ID.contains(int(digits))):
                raise invalid("logit_bias", f"logit_bias: {key[:40]!r} is not a token id")
        return self

    def token_logit_bias(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None


class ChatCompletionRequest(SamplingFields):
    messages: Messages
    max_completion_tokens: int | None = _bounded("max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = _bounded("logprobs")
    response_format: ResponseFormat | None = None
    # Checked by hand (engine/tools/calling.py), as warmup templates are, so both refuse
    # the same things with the same messages, each naming its parameter.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None  # the deprecated form of tools
    function_call: Any = None

    @model_validator(mode="after")
    def _tools_are_usable(self) -> ChatCompletionRequest:
        if self.functions or self.function_call is not None:
            # Answering as if no functions were offered would look like a model that chose
            # not to call one; say plainly what to send instead.
            raise invalid("functions", "functions: the deprecated functions / function_call form is not "
                          "supported; send tools and tool_choice instead")
        problem = _message_problem(self.messages) or _tools_problem(self.tools, self.tool_choice)
        if problem:
            raise invalid(*problem)
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: (
        str
        | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = _bounded("max_tokens", 16)
    logprobs: int | None = _bounded("logprobs")
    echo: bool = False
    response_format: ResponseFormat | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """Validates the one shape the prompt has (by its first element) instead of trying
        every member of the union: 50,000 prompts would otherwise give 50,000 errors."""
        if not isinstance(value, list) or not value:
            return handler(value)
        first = value[0]
        adapter: TypeAdapter[Any]
        if isinstance(first, int) and not isinstance(first, bool):
            adapter = _TOKEN_IDS
        elif isinstance(first, list):
            adapter = _TOKEN_ID_LISTS
        else:
            adapter = _TEXTS
        try:
            return adapter.validate_python(value)
        except ValidationError as e:
            err = e.errors()[0]
            where = "".join(f"[{p}]" for p in err["loc"])
            raise invalid("prompt", f"prompt{where}: {err['msg']}") from None

    @model_validator(mode="after")
    def _no_best_of_or_suffix(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of", "best_of: generating best_of candidates and returning the n best is "
                          "not supported; omit best_of or set it equal to n")
        if self.suffix:
            raise invalid("suffix", "suffix: insertion (suffix) is not supported by this server")
        sequences = len(self.prompts()) * self.n
        if sequences > MAX_SEQUENCES_PER_REQUEST:
            raise invalid("n", f"n: {len(self.prompts())} prompts x n={self.n} is {sequences} completions; "
                          f"one request may ask for at most {MAX_SEQUENCES_PER_REQUEST}")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a completion prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    tools: list[Any] | None = None  # messages only: rendered as a chat request renders them
    add_special_tokens: bool = True  # prompt only: the template writes its own
    add_generation_prompt: bool = True  # messages only

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise invalid("prompt", "prompt: give exactly one of prompt or messages")
        problem = _message_problem(self.messages or []) or _tools_problem(self.tools, None)
        if problem:
            raise invalid(*problem)
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: TokenIds


_TEXTS = TypeAdapter(Annotated[list[str], Field(max_length=MAX_PROMPTS)])
_TOKEN_IDS = TypeAdapter(TokenIds)
_TOKEN_ID_LISTS = TypeAdapter(Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS)])

