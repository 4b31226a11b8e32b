"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx."""

from __future__ import annotations

import math

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds, sent as Retry-After (429, 503)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_validation_error(err: ValidationError) -> APIError:
    """The most telling problem pydantic found, named by its dotted parameter path. A
    whole-request check names its parameter in the error's context (see
    openai_protocol.invalid); a value that fits no member of a union reports the member's
    range or length problem rather than "not a string"."""
    errors = err.errors()
    first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    ctx = first.get("ctx") or {}
    msg = str(first.get("msg", "invalid value"))
    if "param" in ctx:
        return APIError(400, msg, param=str(ctx["param"]), code="invalid_value")
    param = ".".join(_param_path(first.get("loc", ()))) or None
    if param:
        msg = f"{param}: {msg}"
    return APIError(400, msg, param=param, code="invalid_value" if param else None)


def _param_path(loc: tuple) -> list[str]:
    """Field names and list indices, without pydantic's union-member tags ("str",
    "list[constrained-int]", "function-wrap[...]")."""
    out = []
    for part in loc:
        text = str(part)
        # A union member's tag: "str", "list[...]", "function-wrap[...]", or a model's
        # class name (CamelCase; request fields are snake_case).
        if isinstance(part, str) and ("[" in text or "-" in text or text in _TYPE_TAGS or text[:1].isupper()):
            continue
        out.append(text)
    return out


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
