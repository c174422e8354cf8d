"""HTTP errors in OpenAI's shape, and the mapping from engine and validation errors to them.

Every error the app answers has the body `{"error": {"message", "type", "param", "code"}}`
(vLLM's flavour: `type` names the error class, `code` is the HTTP status). Routes raise
`APIError`; `error_from_exception` turns engine errors (dead engine, admission limits, a failed
request) and validation errors (`ValueError` from SamplingParams or the input processor,
`msgspec.ValidationError` from body decoding) into one, both for plain responses and for the
error chunk of a stream. `EXCEPTION_HANDLERS` is what `build_app` installs in Starlette.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from ringserve.engine.errors import (
    EngineDeadError,
    EngineGenerateError,
    EngineRecoveringError,
    MaxQueuedTokensError,
    QueueOverflowError,
)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# "SamplingParams.temperature: got ..." names the field; so does msgspec's "- at `$.n`", and a
# leading field or dotted path ("prompt: ...", "structured_outputs.json: ...").
_SAMPLING_FIELD = re.compile(r"^SamplingParams\.(\w+):")
_LEADING_FIELD = re.compile(r"^(\w+(?:\.\w+)*):")
_MSGSPEC_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING_FIELD = re.compile(r"missing required field `(\w+)`")


class ErrorInfo(msgspec.Struct):
    """The inner object of an error body."""

    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    """`{"error": {...}}`."""

    error: ErrorInfo


class APIError(Exception):
    """An error answered to the client with `status` and OpenAI's error body.

    Args:
        status: the HTTP status.
        message: what is wrong and, for bad input, what is allowed.
        param: the offending request field, when there is one.
    """

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> ErrorResponse:
        """The error body."""
        kind = _TYPES.get(self.status) or HTTPStatus(self.status).phrase.replace(" ", "")
        return ErrorResponse(ErrorInfo(self.message, kind, self.param, self.status))

    def response(self, headers: Mapping[str, str] | None = None) -> Response:
        """A JSON response carrying this error."""
        return Response(msgspec.json.encode(self.body()), status_code=self.status,
                        headers=headers, media_type="application/json")


ErrorRenderer = Callable[[str, APIError, Mapping[str, str] | None], Response]
"""How an error is answered on a path (as the router matches it): OpenAI's body by default;
the Messages routes answer Anthropic's (`ringserve.http.agents.messages_errors`)."""


def openai_error_response(path: str, error: APIError,
                          headers: Mapping[str, str] | None = None) -> Response:
    """The default `ErrorRenderer`: OpenAI's error body on every path."""
    return error.response(headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 naming the offending field."""
    return APIError(400, message, param)


def _param_of(message: str) -> str | None:
    for pattern in (_SAMPLING_FIELD, _MSGSPEC_PATH, _MISSING_FIELD, _LEADING_FIELD):
        match = pattern.search(message)
        if match:
            return match.group(1) or None
    return None


def error_from_exception(exc: BaseException) -> APIError | None:
    """The APIError for an engine or validation error; None for anything else (a bug).

    ValueError means the input was rejected (SamplingParams, the input processor, a utility
    call's argument check), so it is the client's 400.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"The engine is not available: {exc}")
    if isinstance(exc, QueueOverflowError | MaxQueuedTokensError):
        return APIError(503, f"The server is overloaded: {exc}")
    if isinstance(exc, EngineRecoveringError):
        return APIError(503, f"The engine is recovering from a fault; try again later ({exc})")
    if isinstance(exc, EngineGenerateError):
        return APIError(500, str(exc))
    if isinstance(exc, msgspec.ValidationError | msgspec.DecodeError):
        return bad_request(f"Invalid request body: {exc}", _param_of(str(exc)))
    if isinstance(exc, ValueError):
        return bad_request(str(exc), _param_of(str(exc)))
    return None


async def _api_error(request: Request, exc: Exception) -> Response:
    error = error_from_exception(exc)
    assert error is not None  # installed only for the classes error_from_exception maps
    return error.response()


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Not found: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message).response(headers=exc.headers)


EXCEPTION_HANDLERS: dict[Any, Any] = {
    HTTPException: _http_exception,
    APIError: _api_error,
    EngineDeadError: _api_error,
    EngineGenerateError: _api_error,
    QueueOverflowError: _api_error,
    MaxQueuedTokensError: _api_error,
}
