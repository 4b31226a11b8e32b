"""Every error the app answers is OpenAI-shaped (`{"error": {"message", "type", "param",
"code"}}`) and counted in `preheat_request_errors_total{status}`: the API's own refusals
(APIError), Starlette's (404 for an unknown route, 405), and any unexpected exception, which
answers `internal error: <type>` only (its text may hold request data: it goes to the log).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from preheat.engine.metrics import Metrics
from preheat.engine.request.api_errors import APIError, error_body

log = logging.getLogger(__name__)


def add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        metrics.request_errors.labels(status=str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        metrics.request_errors.labels(status=str(exc.status_code)).inc()
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        metrics.request_errors.labels(status="500").inc()
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)
