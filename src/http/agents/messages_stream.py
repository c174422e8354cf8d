"""A Messages reply as content blocks and as Anthropic's stream events.

`ContentBuilder` takes the turn's parsed deltas (`ChoiceDelta`: reasoning, content, tool-call
deltas) in the order they come and keeps the blocks they make: a block opens when the kind
changes (reasoning -> `thinking`, content -> `text`, a new call -> `tool_use`), and within
one delta reasoning comes before content and content before calls. `feed` returns the
events that say the same (`content_block_start`, `content_block_delta` with a
`thinking_delta`, `text_delta` or `input_json_delta`, and before a thinking block's
`content_block_stop` a `signature_delta` with the empty signature this server gives),
`blocks()` the message's content. The route feeds the same builder for a plain reply and a
stream, so the streamed deltas join to exactly the plain reply's blocks. A `tool_use` block's
`input` is its arguments parsed (`{}` when they are not a JSON object, as for a call cut
short by `max_tokens`).

Also here: the stream's other events (`message_start`, `message_delta`, `message_stop`,
`ping`), how a turn's result becomes Anthropic's `stop_reason` and `usage`, the `Framing`
that writes each event as `event: <type>` + `data:` (errors as an `error` event in
Anthropic's body, no `[DONE]`), and `KeepAlive`, the pings sent while the first delta is
awaited (a long prompt's prefill can take a while, and proxies drop idle streams).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from ringserve.http.agents.messages_errors import anthropic_body
from ringserve.http.agents.messages_protocol import (
    MessageOut,
    OutBlock,
    OutputTokensDetails,
    TextOut,
    ThinkingOut,
    ToolUseOut,
    Usage,
)
from ringserve.http.agents.turn import TurnResult
from ringserve.http.chat_output import ChoiceDelta
from ringserve.http.errors import APIError
from ringserve.http.streaming import Emit, Framing, named_event
from ringserve.http.tool_parsers.base import ToolCallDelta, new_call_id

# Seconds between pings while the first delta is awaited.
PING_INTERVAL_S = 10.0


class _Event(msgspec.Struct, tag_field="type", kw_only=True):
    """A stream event (its tag is the `event:` name)."""


class MessageStart(_Event, tag="message_start"):
    """The message, with no content yet and the usage known before generation."""

    message: MessageOut


class ContentBlockStart(_Event, tag="content_block_start"):
    """A block opens (empty)."""

    index: int
    content_block: OutBlock


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    """More text."""

    text: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    """More thinking."""

    thinking: str


class SignatureDelta(msgspec.Struct, tag_field="type", tag="signature_delta"):
    """A thinking block's signature (always "")."""

    signature: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    """More of a tool call's arguments (JSON text)."""

    partial_json: str


Delta = TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class ContentBlockDelta(_Event, tag="content_block_delta"):
    """More of the block `index`."""

    index: int
    delta: Delta


class ContentBlockStop(_Event, tag="content_block_stop"):
    """The block `index` is complete."""

    index: int


class StopInfo(msgspec.Struct):
    """`message_delta.delta`."""

    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(_Event, tag="message_delta"):
    """Why the message ended, and the final usage (it replaces message_start's)."""

    delta: StopInfo
    usage: Usage


class MessageStop(_Event, tag="message_stop"):
    """The end of the stream."""


class Ping(_Event, tag="ping"):
    """Nothing yet: keeps the connection alive."""


Event = MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | \
    MessageDelta | MessageStop | Ping


def _encode_event(body: Any) -> bytes:
    return named_event(type(body).__struct_config__.tag, body)


def _encode_error(error: APIError) -> bytes:
    return named_event("error", anthropic_body(error))


FRAMING = Framing(event=_encode_event, error=_encode_error, done=b"")


@dataclass
class _Block:
    """A block being built: its kind, its text (or arguments) in pieces, a call's id and
    name."""

    kind: str
    pieces: list[str] = field(default_factory=list)
    id: str = ""
    name: str = ""


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class ContentBuilder:
    """A reply's content blocks, built from its parsed deltas.

    Args:
        show_thinking: thinking blocks carry their text (else they stay empty, as
            Anthropic's `display: "omitted"` asks).
    """

    def __init__(self, show_thinking: bool = True) -> None:
        self.show_thinking = show_thinking
        self._blocks: list[_Block] = []
        self._open: int | None = None
        self._calls: dict[int, int] = {}  # the parser's call index -> block index

    def feed(self, piece: ChoiceDelta) -> list[Event]:
        """The events of one delta."""
        events: list[Event] = []
        if piece.reasoning:
            self._add("thinking", piece.reasoning if self.show_thinking else "", events)
        if piece.content:
            self._add("text", piece.content, events)
        for call in piece.tool_calls:
            self._call(call, events)
        return events

    def finish(self) -> list[Event]:
        """The events that close the last block."""
        events: list[Event] = []
        self._close(events)
        return events

    def blocks(self) -> list[OutBlock]:
        """The message's content."""
        out: list[OutBlock] = []
        for block in self._blocks:
            text = "".join(block.pieces)
            if block.kind == "text":
                out.append(TextOut(text=text))
            elif block.kind == "thinking":
                out.append(ThinkingOut(thinking=text))
            else:
                out.append(ToolUseOut(id=block.id, name=block.name, input=_arguments(text)))
        return out

    def _start(self, block: _Block, events: list[Event]) -> int:
        self._close(events)
        index = len(self._blocks)
        self._blocks.append(block)
        self._open = index
        empty: OutBlock
        if block.kind == "text":
            empty = TextOut(text="")
        elif block.kind == "thinking":
            empty = ThinkingOut(thinking="")
        else:
            empty = ToolUseOut(id=block.id, name=block.name, input={})
        events.append(ContentBlockStart(index=index, content_block=empty))
        return index

    def _close(self, events: list[Event]) -> None:
        if self._open is None:
            return
        if self._blocks[self._open].kind == "thinking":
            events.append(ContentBlockDelta(index=self._open, delta=SignatureDelta("")))
        events.append(ContentBlockStop(index=self._open))
        self._open = None

    def _add(self, kind: str, text: str, events: list[Event]) -> None:
        index = self._open
        if index is None or self._blocks[index].kind != kind:
            index = self._start(_Block(kind), events)
        if not text:
            return
        self._blocks[index].pieces.append(text)
        delta: Delta = TextDelta(text) if kind == "text" else ThinkingDelta(text)
        events.append(ContentBlockDelta(index=index, delta=delta))

    def _call(self, call: ToolCallDelta, events: list[Event]) -> None:
        index = self._calls.get(call.index)
        if index is None or call.id is not None:
            block = _Block("tool_use", id=call.id or new_call_id(), name=call.name or "")
            index = self._calls[call.index] = self._start(block, events)
        if call.arguments:
            self._blocks[index].pieces.append(call.arguments)
            events.append(ContentBlockDelta(index=index,
                                            delta=InputJsonDelta(call.arguments)))


def stop_of(result: TurnResult, capped: bool) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` of a finished turn.

    Args:
        capped: the output was capped below the request's `max_tokens` by the room the
            context left (reaching that cap is `model_context_window_exceeded`).

    Raises:
        APIError: 503 when the engine aborted the request (Anthropic's 529 overloaded, which
            its clients retry).
    """
    reason = result.finish_reason
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return ("model_context_window_exceeded" if capped else "max_tokens"), None
    if reason == "abort":
        raise APIError(503, "The engine aborted the request before it finished; retry it")
    if isinstance(result.stop_reason, str):
        return "stop_sequence", result.stop_reason
    return "end_turn", None


def usage_of(result: TurnResult) -> Usage:
    """The turn's usage in Anthropic's convention."""
    details = (OutputTokensDetails(thinking_tokens=result.reasoning_tokens)
               if result.reasoning_tokens else None)
    return Usage(input_tokens=result.prompt_tokens - result.cached_tokens,
                 cache_read_input_tokens=result.cached_tokens,
                 output_tokens=result.output_tokens, output_tokens_details=details)


def final_events(result: TurnResult, capped: bool) -> list[Event]:
    """`message_delta` (stop reason, final usage) and `message_stop`."""
    stop_reason, stop_sequence = stop_of(result, capped)
    return [MessageDelta(delta=StopInfo(stop_reason, stop_sequence), usage=usage_of(result)),
            MessageStop()]


class KeepAlive:
    """Pings every `PING_INTERVAL_S` until `stop` (the first delta, or the end).

    `run` goes in the producer's nursery; `stop` returns once no ping is being written, so
    the producer's next event never interleaves with one.
    """

    def __init__(self, emit: Emit) -> None:
        self._emit = emit
        self._stopped = trio.Event()
        self._writing = trio.Lock()

    async def run(self) -> None:
        """Ping until stopped."""
        while True:
            with trio.move_on_after(PING_INTERVAL_S):
                await self._stopped.wait()
                return
            async with self._writing:
                if self._stopped.is_set():
                    return
                try:
                    await self._emit(Ping())
                except OSError:
                    return  # the client left: the producer learns it from its own write

    async def stop(self) -> None:
        """No more pings (idempotent)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        async with self._writing:
            pass  # a ping being written finishes first
