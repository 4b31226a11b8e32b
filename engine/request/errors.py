"""Typed refusals and failures of one request, raised by the engine and mapped to HTTP by the
server (engine/api/refusals.py): the server never reads a message to decide a status.

- `RequestRejected`: the request cannot run as sent (400 with `code` and `param`). It is a
  ValueError, so callers of the Python API that catch ValueError keep working.
- `QueueFull`: the request is fine but the engine has no room for it now (429, Retry-After).
- `RequestFailed`: the request was accepted and then failed inside the engine (500); the
  engine itself goes on serving everyone else.
"""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request the engine refuses before queueing it. `code` is machine-readable
    (e.g. "invalid_value", "context_length_exceeded", "invalid_grammar"); `param` names the
    request field at fault, in the OpenAI API's terms, or None for the request as a whole."""

    status = 400

    def __init__(self, code: str, param: str | None, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.param = param
        self.message = message


class QueueFull(RequestRejected):
    """The waiting queue (`--max-queue-len`) or the grammar compiler has no room now; the
    same request may succeed after `retry_after` seconds."""

    status = 429

    def __init__(self, code: str, message: str, retry_after: float = 1.0) -> None:
        super().__init__(code, None, message)
        self.retry_after = retry_after


class RequestFailed(RuntimeError):
    """An accepted request failed inside the engine (preparing, sampling, detokenizing); it
    was aborted and its KV pages freed. The message names the failure."""
