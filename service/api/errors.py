"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with a fitting HTTP status.

Every error the HTTP API answers goes through here: our own (APIError), FastAPI's validation errors (400 with
`param` = the field), Starlette's HTTP errors (unknown routes, wrong methods, oversize bodies) and the engine's
refusals (Rejected: 429 with Retry-After and `x-should-retry: false`, or 503 while draining) and generations that
ended without their answer.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.answers import ErrorDetail, ErrorResponse
from service.engine.engine import Rejected
from service.engine.request import Delta, outcome_of

log = logging.getLogger("parley.api")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # as OpenAI answers a missing or wrong key (code invalid_api_key)
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "overloaded",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to answer with OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code))


def retry_after_header(seconds: float) -> str:
    """Retry-After in whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


def from_rejected(r: Rejected) -> APIError:
    """The engine's refusal: 429 `overloaded` (the OpenAI SDK must not retry it silently), or 503 while draining."""
    headers = {"Retry-After": retry_after_header(r.retry_after_s)}
    if r.status == 429:
        headers["x-should-retry"] = "false"
        return APIError(429, r.message, code=r.reason, type="overloaded", headers=headers)
    return APIError(r.status, r.message, code=r.reason, headers=headers)


def from_unfinished(last: Delta) -> APIError | None:
    """A generation's last delta, when it ended without its answer: failed by the engine (500), or cancelled by the
    server (503: a drain that ran out of time); None when it completed."""
    outcome = outcome_of(last.finish_reason)
    if outcome == "failed":
        return APIError(500, f"generation failed: {last.error or 'engine error'}", code="engine_error")
    if outcome == "cancelled":
        return APIError(503, "the request was cancelled", code="cancelled")
    return None


def from_validation(exc: RequestValidationError) -> APIError:
    """FastAPI's RequestValidationError → 400 invalid_request_error, `param` = the offending field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    # Of the errors in the first offending field, the deepest: where a union's alternatives all failed (content
    # as a string or as a list of messages), it is the one inside the alternative the input actually took.
    top = _field_path(errors[0])[:1]
    in_field = [x for x in errors if _field_path(x)[:1] == top]
    e = max(in_field, key=lambda x: len(_field_path(x)))
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    kind = e.get("type", "")
    if kind == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}",
                        code="invalid_json")
    if not loc and kind in ("missing", "model_attributes_type", "model_type", "dict_type"):
        return APIError(400, "the body must be a JSON object (send Content-Type: application/json)",
                        code="invalid_body")
    # Union members show up in the location (e.g. prompt.str, prompt.list[int]); keep the field path only.
    param = ".".join(_field_path(e)) or None
    same = [x for x in errors if _field_path(x) == _field_path(e)]
    msgs = list(dict.fromkeys(_clean(x.get("msg", "invalid value")) for x in same))
    msg = " or ".join(msgs)
    code = "missing_required_parameter" if kind == "missing" else "invalid_value"
    message = f"{param}: {msg}" if param else msg
    others = len(errors) - len(in_field)
    if others:
        message += f" (and {others} more error{'s' if others > 1 else ''})"
    return APIError(400, message, param=param, code=code)


def from_unparsable_body(cause: BaseException) -> APIError:
    """A body FastAPI's JSON parsing raised on (other than a JSONDecodeError): bytes that are not UTF-8, or JSON
    nested deeper than the parser goes."""
    if isinstance(cause, UnicodeDecodeError):
        return APIError(400, f"the body is not valid UTF-8 (byte {cause.start}: {cause.reason})",
                        code="invalid_encoding")
    if isinstance(cause, RecursionError):
        return APIError(400, "the body is not valid JSON: it is nested too deeply", code="invalid_json")
    return APIError(400, f"the body is not valid JSON: {type(cause).__name__}", code="invalid_json")


def _field_path(e: Any) -> list[str]:
    return [str(p) for p in e.get("loc", ()) if p != "body" and not _is_type_tag(str(p))]


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or ("[" in part and part.endswith("]")) or part.startswith(
        ("function-", "constrained-"))


def _clean(msg: str) -> str:
    return msg.removeprefix("Value error, ")


def install(app: FastAPI) -> None:
    """Route every error the app can raise to OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(Rejected)
    async def _rejected(request: Request, exc: Rejected) -> JSONResponse:
        return from_rejected(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 404:
            err = APIError(404, f"no route {request.method} {request.url.path}", code="not_found")
        elif status == 405:
            err = APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                           code="method_not_allowed")
        elif status == 413:
            err = APIError(413, str(exc.detail), code="request_too_large")
        elif status == 400 and exc.__cause__ is not None:  # FastAPI could not parse the body at all
            err = from_unparsable_body(exc.__cause__)
        else:
            err = APIError(status, str(exc.detail))
        err.headers.update(exc.headers or {})
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error").response()
