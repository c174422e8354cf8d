"""One response's run: its output items built from the turn's parsed deltas and, when it
streams, OpenAI's events with a stream-wide `sequence_number`.

`ResponseRun` sends `response.created` and `response.in_progress`, then for each output item
`response.output_item.added`, its parts and deltas, and `response.output_item.done`:

- a reasoning item (with `--reasoning-parser`): `response.content_part.added` (a
  `reasoning_text` part), `response.reasoning_text.delta`..., `response.reasoning_text.done`,
  `response.content_part.done`;
- the message: `response.content_part.added` (an `output_text` part),
  `response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`;
- each function call: `response.function_call_arguments.delta`...,
  `response.function_call_arguments.done`;

and ends with `response.completed`, `response.incomplete` (the output cap or the context ran
out; the item it cut is `incomplete`) or `response.failed`. Items follow each other: one
closes when the next opens (the parsers give reasoning, then content, then calls). A plain
response runs the same writer over the whole result as one delta and sends nothing, so the
output of `response.completed` is the non-streamed output, ids aside, and the deltas join to
exactly its texts and arguments. A reply with neither calls nor text still gets its (empty)
message, as OpenAI's does, so `output_text` is "".

(Text the tool parser leaves after a call's markup, which models rarely write, opens a
second message item when streamed; a plain response puts all its text in one message.)
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from starlette.types import Receive

from ringserve.http.agents.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    Item,
    MessageItem,
    OutputItemEvent,
    OutputText,
    OutputTokensDetails,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
    Usage,
    new_id,
)
from ringserve.http.agents.turn import Turn, TurnResult, run_turn
from ringserve.http.chat_output import ChoiceDelta
from ringserve.http.context import AppContext
from ringserve.http.errors import APIError
from ringserve.http.tool_parsers.base import ToolCallDelta, new_call_id

EmitEvent = Callable[[StreamEvent], Awaitable[None]]

REASONING, MESSAGE, CALL = "reasoning", "message", "function_call"


@dataclass
class _Open:
    """The output item being written."""

    kind: str
    index: int
    id: str
    text: str = ""  # the reasoning or message text, or the call's arguments
    call_id: str = ""
    name: str = ""


class OutputWriter:
    """Builds one response's output items from parsed deltas, and its events when `emit`
    is given (the sequence numbers count from 0 across the whole stream)."""

    def __init__(self, emit: EmitEvent | None) -> None:
        self._emit = emit
        self._sequence = 0
        self._open: _Open | None = None
        self._calls: dict[int, _Open] = {}  # tool-call index -> its item
        self.items: list[Item] = []  # the closed items, in output order
        self.has_message = False

    async def _send(self, event: StreamEvent) -> None:
        self._sequence += 1
        if self._emit is not None:
            await self._emit(event)

    @property
    def _seq(self) -> int:
        return self._sequence

    async def lifecycle(self, kind: str, response: ResponseObject) -> None:
        """Send `response.<kind>` carrying `response`."""
        await self._send(ResponseEvent(type=f"response.{kind}", sequence_number=self._seq,
                                       response=response))

    async def delta(self, piece: ChoiceDelta) -> None:
        """Take one parsed delta (reasoning, then content, then call pieces)."""
        if piece.reasoning:
            await self._text(REASONING, piece.reasoning)
        if piece.content:
            await self._text(MESSAGE, piece.content)
        for call in piece.tool_calls:
            await self._call(call)

    async def finish(self, incomplete: bool) -> list[Item]:
        """Close the last item (`incomplete`: it was cut) and return the output items."""
        if not self.has_message and not self._calls and (not incomplete or self._open is None):
            await self._close("completed")
            await self._start(MESSAGE)
        await self._close("incomplete" if incomplete else "completed")
        return self.items

    async def _text(self, kind: str, text: str) -> None:
        item = self._open
        if item is None or item.kind != kind:
            await self._close("completed")
            item = await self._start(kind)
        item.text += text
        if kind == REASONING:
            await self._send(ReasoningDeltaEvent(sequence_number=self._seq, item_id=item.id,
                                                 output_index=item.index, content_index=0,
                                                 delta=text))
        else:
            await self._send(TextDeltaEvent(sequence_number=self._seq, item_id=item.id,
                                            output_index=item.index, content_index=0,
                                            delta=text))

    async def _call(self, piece: ToolCallDelta) -> None:
        item = self._calls.get(piece.index)
        if item is None:
            await self._close("completed")
            item = await self._start(CALL, piece)
        if piece.arguments:
            item.text += piece.arguments
            await self._send(ArgumentsDeltaEvent(sequence_number=self._seq, item_id=item.id,
                                                 output_index=item.index,
                                                 delta=piece.arguments))

    async def _start(self, kind: str, call: ToolCallDelta | None = None) -> _Open:
        index = len(self.items)
        if kind == CALL:
            assert call is not None
            item = _Open(CALL, index, new_id("fc"), call_id=call.id or new_call_id(),
                         name=call.name or "")
            self._calls[call.index] = item
        else:
            item = _Open(kind, index, new_id("rs" if kind == REASONING else "msg"))
            self.has_message = self.has_message or kind == MESSAGE
        self._open = item
        await self._send(OutputItemEvent(type="response.output_item.added",
                                         sequence_number=self._seq, output_index=index,
                                         item=_item(item, "in_progress")))
        if kind != CALL:
            part: OutputText | ReasoningText = (ReasoningText("") if kind == REASONING
                                                else OutputText(""))
            await self._send(ContentPartEvent(type="response.content_part.added",
                                              sequence_number=self._seq, item_id=item.id,
                                              output_index=index, content_index=0, part=part))
        return item

    async def _close(self, status: str) -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        at, index = item.id, item.index
        if item.kind == CALL:
            await self._send(ArgumentsDoneEvent(sequence_number=self._seq, item_id=at,
                                                output_index=index, arguments=item.text))
        else:
            part: OutputText | ReasoningText
            if item.kind == REASONING:
                part = ReasoningText(item.text)
                await self._send(ReasoningDoneEvent(sequence_number=self._seq, item_id=at,
                                                    output_index=index, content_index=0,
                                                    text=item.text))
            else:
                part = OutputText(item.text)
                await self._send(TextDoneEvent(sequence_number=self._seq, item_id=at,
                                               output_index=index, content_index=0,
                                               text=item.text))
            await self._send(ContentPartEvent(type="response.content_part.done",
                                              sequence_number=self._seq, item_id=at,
                                              output_index=index, content_index=0, part=part))
        done = _item(item, status)
        self.items.append(done)
        await self._send(OutputItemEvent(type="response.output_item.done",
                                         sequence_number=self._seq, output_index=index,
                                         item=done))


def _item(item: _Open, status: str) -> Item:
    """The output item of `item` (empty while it is only being added)."""
    adding = status == "in_progress"
    if item.kind == CALL:
        return FunctionCallItem(id=item.id, call_id=item.call_id, name=item.name,
                                arguments="" if adding else item.text, status=status)
    if item.kind == REASONING:
        return ReasoningItem(id=item.id, content=[] if adding else [ReasoningText(item.text)],
                             status=status)
    return MessageItem(id=item.id, role="assistant",
                       content=[] if adding else [OutputText(item.text)], status=status)


def whole(result: TurnResult) -> ChoiceDelta:
    """A plain turn's result as one delta."""
    calls = [ToolCallDelta(i, call.id, call.name, call.arguments)
             for i, call in enumerate(result.calls)]
    return ChoiceDelta(reasoning=result.reasoning, content=result.content, tool_calls=calls)


def usage_of(result: TurnResult) -> Usage:
    """The response's usage: the engine's counts."""
    return Usage(input_tokens=result.prompt_tokens,
                 input_tokens_details=InputTokensDetails(cached_tokens=result.cached_tokens),
                 output_tokens=result.output_tokens,
                 output_tokens_details=OutputTokensDetails(
                     reasoning_tokens=result.reasoning_tokens),
                 total_tokens=result.prompt_tokens + result.output_tokens)


def finished(base: ResponseObject, result: TurnResult, items: list[Item]) -> ResponseObject:
    """The response once its turn ended: completed, incomplete (cut by the output cap or
    the context) or failed (the engine aborted it)."""
    status, details, error = "completed", None, None
    if result.finish_reason == "length":
        status, details = "incomplete", IncompleteDetails(reason="max_output_tokens")
    elif result.finish_reason == "abort":
        status = "failed"
        error = ResponseError(code="server_error", message="The engine aborted the request")
    return msgspec.structs.replace(base, status=status, output=items, usage=usage_of(result),
                                   incomplete_details=details, error=error,
                                   completed_at=int(time.time()))


class ResponseRun:
    """Runs one prepared turn as one response.

    Args:
        ctx: the app's context.
        turn: the prepared engine request.
        base: the response object as it starts (`in_progress`, no output).
        emit: where the events go (None: a plain or background response, no events).
    """

    def __init__(self, ctx: AppContext, turn: Turn, base: ResponseObject,
                 emit: EmitEvent | None = None) -> None:
        self.ctx = ctx
        self.turn = turn
        self.base = base
        self.writer = OutputWriter(emit)
        self.streams = emit is not None

    async def run(self, receive: Receive | None = None) -> ResponseObject | None:
        """The finished response; None when the client left (`receive`: a plain request's,
        whose disconnect aborts the engine request).

        Raises:
            The engine's errors, as `run_turn` raises them (see `fail`).
        """
        writer = self.writer
        await writer.lifecycle("created", self.base)
        await writer.lifecycle("in_progress", self.base)
        on_delta = writer.delta if self.streams else None
        result = await run_turn(self.ctx, self.turn, on_delta, receive)
        if result is None:
            return None
        if not self.streams:
            await writer.delta(whole(result))
        items = await writer.finish(incomplete=result.finish_reason == "length")
        final = finished(self.base, result, items)
        await writer.lifecycle(final.status, final)
        return final

    async def fail(self, error: APIError) -> ResponseObject:
        """The failed response after `run` raised (its closed items kept), announced by
        `response.failed` when streaming."""
        code = "server_error" if error.status >= 500 else "invalid_prompt"
        failed = msgspec.structs.replace(
            self.base, status="failed", output=list(self.writer.items),
            error=ResponseError(code=code, message=error.message),
            completed_at=int(time.time()))
        await self.writer.lifecycle("failed", failed)
        return failed
