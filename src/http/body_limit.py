"""The request-body size limit (`--max-request-body-bytes`): 413 in the path's error shape.

A declared Content-Length over the limit is refused before the route runs; a body without
one (chunked, HTTP/2) is counted as it is read, and the read fails with an APIError 413 that
the route's guard answers. (Starlette's own limit answers plain text, and replaces the
route's response when Content-Length is too large, so it is not used.)
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ringserve.http.auth import route_path
from ringserve.http.errors import APIError, ErrorRenderer, openai_error_response


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the limit of {limit} bytes")


class BodyLimitMiddleware:
    """Refuses request bodies over `limit` bytes."""

    def __init__(self, app: ASGIApp, *, limit: int,
                 render: ErrorRenderer = openai_error_response) -> None:
        self.app = app
        self.limit = limit
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self.render(route_path(scope), _too_large(self.limit), None)(scope, receive,
                                                                               send)
            return
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _too_large(self.limit)
            return message

        await self.app(scope, receive_limited, send)
