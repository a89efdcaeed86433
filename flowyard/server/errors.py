"""OpenAI-style error bodies and the handlers that guarantee every failure is JSON.

Clients (the `openai` package, vLLM's benchmark, curl scripts) branch on the HTTP status and
read `error.message`; a bare-text 404 or a pydantic 422 breaks them. So every path out of the
app - our own checks, FastAPI validation, Starlette routing, unexpected exceptions - ends in
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from flowyard.engine.protocol import EngineUnavailableError
from flowyard.server.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("flowyard.server")

#: The `type` field per status, following OpenAI's naming.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the server answers on purpose, with its status and OpenAI fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code)).model_dump()


def validation_error(errors: Sequence[Any]) -> APIError:
    """Turn pydantic's error list into one readable 400 naming the field (vLLM maps 422 to 400
    the same way). At most three errors are listed: a union mismatch can produce dozens."""
    parts: list[str] = []
    first_param: str | None = None
    for err in list(errors)[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # drop pydantic's union-member tags like 'str' / 'list[int]' / 'function-after[...]'
        loc = [x for x in loc if not (x in {"str", "int", "float", "bool"} or "[" in x)]
        field = ".".join(loc) if loc else "body"
        first_param = first_param or (field if loc else None)
        parts.append(f"{field}: {err.get('msg', 'invalid value')}")
    if len(errors) > 3:
        parts.append(f"(+{len(errors) - 3} more)")
    return APIError(400, "; ".join(parts), param=first_param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Register handlers so that no response leaves the app without an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(_: Request, exc: ValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message, code = f"Invalid URL ({request.method} {request.url.path})", "not_found"
        elif exc.status_code == 405:
            message, code = f"Method {request.method} not allowed on {request.url.path}", "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        return APIError(exc.status_code, message, code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette's ServerErrorMiddleware sends this response and then re-raises for the
        # server to log; routes catch engine failures themselves so this is a backstop.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return server_error(exc).response()


def server_error(exc: BaseException) -> APIError:
    """The error for an exception out of the engine: 503 + Retry-After when it was an
    instance's death or no instance being up (`EngineUnavailableError`), else a 500."""
    if isinstance(exc, EngineUnavailableError):
        return unavailable(exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", code="internal_error")


def unavailable(exc: EngineUnavailableError) -> APIError:
    return APIError(503, f"{exc}", code="instance_unavailable",
                    headers={"Retry-After": str(max(1, math.ceil(exc.retry_after)))})
