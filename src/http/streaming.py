"""Server-sent events: the streaming response of completions and chat completions.

`SSEResponse` runs a producer (`produce(emit)`) next to a listener for the client's
disconnect, in one nursery: the first to finish cancels the other, so a client that leaves
mid-stream cancels the producer, which leaves `AsyncLLM.generate` and aborts its requests
within one engine step (this does not depend on the server's ASGI spec version, unlike
Starlette's StreamingResponse). Each event is `data: <json>\\n\\n`; the stream ends with
`data: [DONE]`. An error after the response started becomes an error chunk
`data: {"error": {...}}` followed by `data: [DONE]`. `on_close` runs however the response
ends (the in-flight count of the server's drain).

That framing is the chat and completions routes' (OpenAI's chat streams). The agents' routes
(`ringserve.http.agents`) frame theirs as named events, `event: <type>` before each `data:`
line and no `[DONE]`, which is what OpenAI's Responses and Anthropic's Messages streams send:
they pass a `Framing` of their own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
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


def named_event(name: str, body: Any) -> bytes:
    """One `event: <name>` + `data:` event carrying a msgspec-encodable body."""
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(body) + b"\n\n"


def _chat_error(error: APIError) -> bytes:
    return sse_event(error.body())


@dataclass(frozen=True)
class Framing:
    """How a stream's events are written.

    Attributes:
        event: one body as the bytes of its event.
        error: the event of an error raised after the response started.
        done: what ends the stream (after the last event, or after the error's).
    """

    event: Callable[[Any], bytes] = sse_event
    error: Callable[[APIError], bytes] = _chat_error
    done: bytes = DONE


CHAT_FRAMING = Framing()


class SSEResponse(Response):
    """A `text/event-stream` response fed by `produce(emit)`.

    Args:
        produce: writes the events through `emit(body)`; its engine and validation errors
            become an error chunk.
        on_close: called once when the response ends, however it ends.
    """

    media_type = "text/event-stream"

    def __init__(self, produce: Produce, on_close: Callable[[], None] | None = None,
                 framing: Framing = CHAT_FRAMING) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._produce = produce
        self.on_close = on_close
        self.framing = framing

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

        framing = self.framing

        async def emit(body: Any) -> None:
            await emit_bytes(framing.event(body))

        try:
            await _produce_with_errors(self._produce, emit, emit_bytes, framing)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away while we wrote (ASGI spec 2.4 servers say so this way)
        scope.cancel()


async def _produce_with_errors(produce: Produce, emit: Emit,
                               emit_bytes: Callable[[bytes], Awaitable[None]],
                               framing: Framing) -> None:
    try:
        await produce(emit)
    except Exception as exc:
        error = error_from_exception(exc)
        await emit_bytes(framing.error(APIError(500, f"Internal error: {exc!r}")
                                       if error is None else error))
        if framing.done:
            await emit_bytes(framing.done)
        if error is None:
            raise  # a bug: the client got its error chunk; the server logs the traceback
        return
    if framing.done:
        await emit_bytes(framing.done)


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
