"""Server-sent events: the streaming response of completions and chat completions.

`SSEResponse` runs a producer (`produce(emit)`) next to a listener for the client's
disconnect, in one nursery: the first to finish cancels the other, so a client that leaves
mid-stream cancels the producer, which leaves `AsyncLLM.generate` and aborts its requests
within one engine step (this does not depend on the server's ASGI spec version, unlike
Starlette's StreamingResponse). Each event is `data: <json>\\n\\n`; the stream ends with
`data: [DONE]`. An error after the response started becomes an error chunk
`data: {"error": {...}}` followed by `data: [DONE]`. `on_close` runs however the response
ends (the in-flight count of the server's drain).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ringserve.http.errors import APIError, error_from_exception

Emit = Callable[[Any], Awaitable[None]]
Produce = Callable[[Emit], Awaitable[None]]

DONE = b"data: [DONE]\n\n"


def sse_event(body: Any) -> bytes:
    """One `data:` event carrying a msgspec-encodable body."""
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


class SSEResponse(Response):
    """A `text/event-stream` response fed by `produce(emit)`.

    Args:
        produce: writes the events through `emit(body)`; its engine and validation errors
            become an error chunk.
        on_close: called once when the response ends, however it ends.
    """

    media_type = "text/event-stream"

    def __init__(self, produce: Produce, on_close: Callable[[], None] | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._produce = produce
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._stream, send, nursery.cancel_scope)
                await _wait_for_disconnect(receive)
                nursery.cancel_scope.cancel()
        finally:
            if self.on_close is not None:
                self.on_close()

    async def _stream(self, send: Send, scope: trio.CancelScope) -> None:
        async def emit_bytes(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        async def emit(body: Any) -> None:
            await emit_bytes(sse_event(body))

        try:
            await _produce_with_errors(self._produce, emit, emit_bytes)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away while we wrote (ASGI spec 2.4 servers say so this way)
        scope.cancel()


async def _produce_with_errors(produce: Produce, emit: Emit,
                               emit_bytes: Callable[[bytes], Awaitable[None]]) -> None:
    try:
        await produce(emit)
    except Exception as exc:
        error = error_from_exception(exc)
        await emit(APIError(500, f"Internal error: {exc!r}").body() if error is None
                   else error.body())
        await emit_bytes(DONE)
        if error is None:
            raise  # a bug: the client got its error chunk; the server logs the traceback
        return
    await emit_bytes(DONE)


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
