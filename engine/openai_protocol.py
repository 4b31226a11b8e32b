"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests validate ranges here so a bad value is a 400 naming the parameter; unknown fields
are ignored, as OpenAI-compatible servers do, so newer SDKs keep working.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 16


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------- requests


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


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
    content: str | list[TextPart] | None = None
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
        """The message as engine/chat_render.py takes it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _message_problem(messages: list[ChatMessage]) -> str | None:
    """Tool turns must be shaped as OpenAI requires: calls only from the assistant, and each
    tool result naming the call it answers."""
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            return f"messages.{i}.tool_calls: only assistant messages carry tool_calls"
        if m.role == "tool" and not m.tool_call_id:
            return f"messages.{i}.tool_call_id: a tool message needs the id of the call it answers"
    return None


def _tools_problem(tools: Any, tool_choice: Any) -> str | None:
    from preheat.engine.tool_calling import tool_choice_problem, tool_problems

    problems = tool_problems(tools) if tools is not None else []
    if problems:
        return "{}: {}".format(*problems[0])
    names = [t["function"]["name"] for t in tools or ()]
    problem = tool_choice_problem(tool_choice, names)
    return "{}: {}".format(*problem) if problem else None


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
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # 0 and -1 both mean off
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = Field(default=None)
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    regex: str | None = None  # SGLang's extra body field
    user: str | None = None
    # OpenAI sends token ids as JSON object keys, i.e. strings.
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _bounded_stop(self) -> SamplingFields:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 16:
            raise ValueError("stop: at most 16 sequences")
        return self

    @model_validator(mode="after")
    def _logit_bias_keys_are_token_ids(self) -> SamplingFields:
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias: {key!r} is not a token id")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias: the bias for token {key} must be in [-100, 100]")
        return self

    def token_logit_bias(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    # Checked by hand (engine/tool_calling.py), as warmup templates are, so both refuse
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
            raise ValueError("functions: the deprecated functions / function_call form is not "
                             "supported; send tools and tool_choice instead")
        problem = _message_problem(self.messages) or _tools_problem(self.tools, self.tool_choice)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    response_format: ResponseFormat | None = None
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _no_best_of_or_suffix(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: generating best_of candidates and returning the n best is "
                             "not supported; omit best_of or set it equal to n")
        if self.suffix:
            raise ValueError("suffix: insertion (suffix) is not supported by this server")
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
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None  # messages only: rendered as a chat request renders them
    add_special_tokens: bool = True  # prompt only: the template writes its own
    add_generation_prompt: bool = True  # messages only

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        problem = _message_problem(self.messages or []) or _tools_problem(self.tools, None)
        if problem:
            raise ValueError(problem)
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]

