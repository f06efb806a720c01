"""OpenAI-style errors: one exception type, one JSON shape, and FastAPI handlers that use them.

Every error a client sees has the body the OpenAI API returns,
`{"error": {"message", "type", "param", "code"}}`, so the official clients raise their usual
typed exceptions (`openai.BadRequestError`, `openai.NotFoundError`, ...). User mistakes are 4xx
(a schema violation is 400, never FastAPI's 422); only our own bugs are 500, and the handler
returns a response instead of letting one bad request take the server down.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
# Pydantic error types that mean "wrong JSON type" rather than "wrong value".
_TYPE_ERRORS = ("_type", "_parsing", "model_attributes_type", "dict_type", "list_type")
_MAX_INPUT_REPR = 80
# What a request's handler sees when its client went away (Serve cancels the request's task).
_DISCONNECTS = (asyncio.CancelledError, TaskCancelledError)


class ErrorInfo(BaseModel):
    """The inner object of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error response: `{"error": {...}}`, as the OpenAI API returns it."""

    error: ErrorInfo


class OpenAIError(Exception):
    """An error that maps to one HTTP status and one OpenAI error body.

    Raise it anywhere under a route; the handlers from `install_error_handlers` turn it into the
    response. `type` defaults from the status (400 -> `invalid_request_error`, 404 ->
    `not_found_error`, ...).
    """

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type or _TYPE_BY_STATUS.get(status_code, "internal_error")
        self.param = param
        self.code = code
        # Sent as `Retry-After`: the client may try again then (busy, or a replica restarts).
        self.retry_after_s = retry_after_s

    def to_response_model(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )

    def __repr__(self) -> str:
        return (f"OpenAIError({self.status_code}, {self.type!r}, {self.message!r}, "
                f"param={self.param!r})")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """400 `invalid_request_error`: the request is well-formed JSON but asks for something wrong."""
    return OpenAIError(message, 400, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """404 `not_found_error`, e.g. `not_found("The model `x` does not exist.", "model",
    "model_not_found")`."""
    return OpenAIError(message, 404, "not_found_error", param, code)


def unauthorized(message: str = "Incorrect API key provided.") -> OpenAIError:
    """401 `authentication_error`, for a missing or wrong bearer key."""
    return OpenAIError(message, 401, "authentication_error", None, "invalid_api_key")


def service_unavailable(message: str, retry_after_s: int = 1) -> OpenAIError:
    """503 with `Retry-After`: not the client's fault, and trying again may well succeed."""
    return OpenAIError(message, 503, "service_unavailable_error", None, None, retry_after_s)


def internal_error(message: str = "Internal server error.") -> OpenAIError:
    """500 `internal_error`: our fault, not the client's."""
    return OpenAIError(message, 500, "internal_error", None, None)


def error_body(exc: BaseException) -> dict[str, Any]:
    """The OpenAI error JSON for any exception; used for responses and for SSE error events."""
    return _as_openai_error(exc).to_response_model().model_dump()


def error_response(exc: BaseException) -> JSONResponse:
    """The JSON response for any exception: its own status for `OpenAIError` and validation
    errors, 500 `internal_error` for anything else."""
    err = _as_openai_error(exc)
    headers = None if err.retry_after_s is None else {"Retry-After": str(err.retry_after_s)}
    return JSONResponse(status_code=err.status_code, content=err.to_response_model().model_dump(),
                        headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error raised under `app` through `error_response`.

    Covers FastAPI's body validation (malformed JSON included), `OpenAIError`, Starlette's
    404/405 for unknown routes, and any other exception (500; Starlette re-raises it after
    responding so the server logs it and goes on). A bare pydantic `ValidationError` is a 500
    on purpose: it comes from our own code building a model; a route that validates a body by
    hand uses `protocol.parse_request`, which raises a 400 `OpenAIError`.
    """

    async def handle(_request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    for exc_type in (RequestValidationError, OpenAIError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, handle)


def _as_openai_error(exc: BaseException) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return from_validation_errors(exc.errors())
    if isinstance(exc, json.JSONDecodeError):
        return bad_request(f"Invalid JSON body: {exc.msg}.", code="invalid_json")
    if isinstance(exc, StarletteHTTPException):
        return OpenAIError(str(exc.detail), exc.status_code)
    if isinstance(exc, _DISCONNECTS):
        # A client that disconnects is normal, and Serve already logs it (one INFO line):
        # no traceback, no error.
        logger.debug("client disconnected; its request was cancelled")
        return OpenAIError("the client disconnected", 499, "client_closed_request")
    # Only bugs reach here: log the traceback for us, keep the details from the client.
    logger.error("unhandled error while serving a request", exc_info=exc)
    return internal_error(f"Internal server error ({type(exc).__name__}).")


def from_validation_errors(errors: Sequence[Any]) -> OpenAIError:
    """A 400 for the most useful of pydantic's (or FastAPI's) validation errors: its field path
    as `param` (`messages[0].role`), a readable message, and an OpenAI-like `code`."""
    if not errors:
        return bad_request("Invalid request.")
    first = _most_specific(errors)
    kind: str = first.get("type", "")
    param = _param_path(first.get("loc", ()))
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "malformed JSON")
        return bad_request(f"Invalid JSON body: {detail}.", code="invalid_json")
    if kind == "missing":
        if param is None:
            return bad_request("The request body is missing.", code="missing_required_parameter")
        return bad_request(f"Missing required parameter: '{param}'.", param,
                           "missing_required_parameter")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    code = "invalid_type" if kind.endswith(_TYPE_ERRORS) else "invalid_value"
    if param is None and code == "invalid_type":
        # FastAPI parses the body as JSON only when the request says it is JSON.
        return bad_request("The request body must be a JSON object (with Content-Type: "
                           "application/json).", None, code)
    if param is None:
        return bad_request(f"Invalid request: {message}.", None, code)
    got = repr(first.get("input"))
    if len(got) > _MAX_INPUT_REPR:
        got = got[: _MAX_INPUT_REPR - 3] + "..."
    return bad_request(f"Invalid '{param}': {message} (got {got}).", param, code)


def _most_specific(errors: Sequence[Any]) -> Any:
    """The first error, or a deeper one about the same field: when a union fails, pydantic
    reports one error per member, and the first (`content` is not a string) is less useful than
    the deepest (`content[0].type` should be 'text')."""
    first = errors[0]
    prefix = _param_path(first.get("loc", ())) or ""
    same_field = [e for e in errors
                  if (_param_path(e.get("loc", ())) or "").startswith(prefix)]
    return max(same_field, key=lambda e: len(e.get("loc", ())))


def _param_path(loc: Sequence[int | str]) -> str | None:
    """`('body', 'messages', 0, 'role')` -> `'messages[0].role'`, the OpenAI spelling.

    Pydantic inserts the name of the union member it tried (`'str'`, `'list[int]'`,
    `'function-after[...]'`) into the location; those are not fields, so they are dropped.
    """
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _is_union_tag(part):
            continue
        else:
            path += f".{part}" if path else part
    return path or None


def _is_union_tag(part: str) -> bool:
    return (part in ("str", "int", "float", "bool", "list", "dict", "none")
            or "[" in part or "-" in part)
