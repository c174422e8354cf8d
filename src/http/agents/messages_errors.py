"""Anthropic's error bodies for `/v1/messages` and `/v1/messages/count_tokens`.

Anthropic's clients read `{"type": "error", "error": {"type": ..., "message": ...}}` and map
the HTTP status to their exception classes. Every `APIError` the shared code raises (a 400
naming the field, the API key's 401, the body limit's 413, an unknown model's 404, an
admission refusal or a draining server's 503) is answered in that shape on these routes; a
503 becomes Anthropic's 529 `overloaded_error`, the status its clients back off and retry on.
`render_error` is the renderer the app hands its middlewares for these paths.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
from starlette.responses import Response

from ringserve.http.errors import APIError

MESSAGES_PREFIX = "/v1/messages"

OVERLOADED = 529

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    OVERLOADED: "overloaded_error",
}


class AnthropicErrorInfo(msgspec.Struct):
    """The inner object of an Anthropic error body."""

    type: str
    message: str


class AnthropicError(msgspec.Struct):
    """`{"type": "error", "error": {...}}`."""

    error: AnthropicErrorInfo
    type: str = "error"


def anthropic_status(error: APIError) -> int:
    """The status Anthropic would answer: 503 (overloaded, draining) becomes 529."""
    return OVERLOADED if error.status == 503 else error.status


def anthropic_body(error: APIError) -> AnthropicError:
    """The error body of `error` in Anthropic's shape."""
    status = anthropic_status(error)
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return AnthropicError(AnthropicErrorInfo(kind, error.message))


def anthropic_response(error: APIError, headers: Mapping[str, str] | None = None) -> Response:
    """A JSON response carrying `error` in Anthropic's shape."""
    return Response(msgspec.json.encode(anthropic_body(error)),
                    status_code=anthropic_status(error), headers=headers,
                    media_type="application/json")


def is_messages_path(path: str) -> bool:
    """The path (as the router matches it) is one of the Messages routes."""
    return path == MESSAGES_PREFIX or path.startswith(MESSAGES_PREFIX + "/")
