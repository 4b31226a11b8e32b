"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_validation_error(err: ValidationError) -> APIError:
    """The first problem pydantic found, named by its dotted parameter path."""
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if not str(p).startswith(("function-after", "str", "list["))]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "value_error":
        # Our own validators' messages, minus pydantic's prefix; a whole-request check that
        # names its parameter ("tools: ...") reports it as the param.
        msg = msg.removeprefix("Value error, ")
        named = re.match(r"([a-z_]+(\.[a-z0-9_]+)*): ", msg)
        if param is None and named:
            param = named.group(1)
            return APIError(400, msg, param=param, code="invalid_value")
    if param:
        msg = f"{param}: {msg}"
    return APIError(400, msg, param=param, code="invalid_value" if param else None)
