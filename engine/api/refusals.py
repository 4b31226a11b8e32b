"""The engine's typed refusals (RequestRejected, QueueFull, EngineNotReady, EngineDead,
RequestFailed) as OpenAI errors: status, code and param come from the exception's type and
fields, never from its message. Before the response started they are raised as APIError;
once a stream answered 200, `stream_error` is the body of its last event.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from preheat.engine.api.openai_protocol import ChatCompletionRequest
from preheat.engine.async_engine import EngineDead, EngineNotReady
from preheat.engine.request.api_errors import APIError, error_body
from preheat.engine.request.errors import RequestFailed, RequestRejected


def prompt_param(req: BaseModel | None) -> str:
    """The field that carried the prompt: a chat request sends messages."""
    return "messages" if isinstance(req, ChatCompletionRequest) else "prompt"


def grammar_param(req: BaseModel | None, kind: str | None) -> str:
    """The request field that carried a refused grammar."""
    if kind == "structural_tag":
        return "tools"  # only tool calling builds structural tags
    return "regex" if getattr(req, "regex", None) is not None else "response_format"


def as_api_error(e: BaseException, req: BaseModel | None) -> BaseException:
    """`e` as the OpenAI error for `req` (None: SGLang's /generate, which renames the fields
    itself); an exception that is no refusal is returned as it is."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestRejected):
        param = e.param
        if param == "prompt":
            param = prompt_param(req)  # the engine says prompt; a chat request sent messages
        elif param is None and e.code.startswith(("invalid_grammar", "grammar_")):
            param = grammar_param(req, getattr(e, "kind", None))
        return APIError(e.status, e.message, param=param, code=e.code, retry_after=getattr(e, "retry_after", None))
    if isinstance(e, EngineNotReady):
        return APIError(503, f"engine is not ready (phase: {e})", code="not_ready")
    if isinstance(e, EngineDead):
        return APIError(500, f"engine failed: {e}", code="engine_dead")
    if isinstance(e, RequestFailed):
        return APIError(500, str(e), code="request_failed")
    if isinstance(e, ValueError):  # an engine without typed refusals (a test double)
        return APIError(400, str(e))
    return e


# What a stream that already answered 200 can still meet.
STREAM_ERRORS = (EngineDead, EngineNotReady, RequestFailed)


def stream_error(e: BaseException) -> dict[str, Any]:
    """The error event of a stream that already answered 200."""
    if isinstance(e, RequestFailed):
        return error_body(500, str(e), code="request_failed")
    return error_body(500, f"engine failed: {e}", code="engine_dead")
