"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API.

A request is decoded (`messages_protocol`), translated into the chat route's request
(`messages_translate`) and run as one agent turn (`turn`): the same chat template, tool and
reasoning parsers, forced-call constraint, admission and prefix cache as
`/v1/chat/completions`. `max_tokens` (required) is capped at the room the context leaves
after the prompt, so an agent's large default still runs on a short-context model; reaching
that cap is the stop reason `model_context_window_exceeded`. The engine hands out deltas for
a plain reply as for a stream, and both feed one `ContentBuilder` (`messages_stream`): the
streamed message is the plain one. A stream sends `message_start` (usage before generation:
the prefix cache's share is known only once the prompt ran, so `message_delta` carries the
final usage, which Anthropic's clients take over), a `ping`, pings every
`PING_INTERVAL_S` until the first delta, the content blocks' events, `message_delta` and
`message_stop`.

`count_tokens` renders and tokenizes the same prompt (no admission, no generation) and
answers `{"input_tokens": N}`, the prompt's length as the engine would run it.

Choices where Anthropic's API has no counterpart here, said once in the log when they come
up: `thinking.budget_tokens` is checked (at least 1024, below `max_tokens`) but does not cut
the reasoning short; `output_config.effort` has no effect; thinking asked for on a server
without `--reasoning-parser` is accepted and the reply has no thinking blocks (any reasoning
the model writes stays in the text). Every error is Anthropic's shape (the app's guard renders
it with `messages_errors`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import trio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ringserve.http.agents.messages_protocol import (
    CountTokensOut,
    MessageOut,
    MessagesRequest,
    ThinkingEnabled,
    Usage,
    explain_block_type,
)
from ringserve.http.agents.messages_stream import (
    FRAMING,
    ContentBuilder,
    KeepAlive,
    MessageStart,
    Ping,
    final_events,
    stop_of,
    usage_of,
)
from ringserve.http.agents.messages_translate import (
    chat_request,
    is_thinking_requested,
    shows_thinking,
)
from ringserve.http.agents.turn import Turn, TurnResult, prepare_turn, run_turn
from ringserve.http.chat_images import render_chat_images
from ringserve.http.chat_output import ChoiceDelta
from ringserve.http.chat_template import chat_conversation, render_chat
from ringserve.http.context import AppContext, Guard, request_id_of
from ringserve.http.errors import APIError, bad_request
from ringserve.http.responses import json_response
from ringserve.http.streaming import Emit, SSEResponse
from ringserve.http.tool_parsers.request import plan_tools
from ringserve.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)




@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


@dataclass(frozen=True)
class _Reply:
    """What a reply says besides its content."""

    id: str
    model: str
    capped: bool
    show_thinking: bool

    def message(self, builder: ContentBuilder, result: TurnResult) -> MessageOut:
        """The whole message: the builder's blocks, the result's stop reason and usage."""
        stop_reason, stop_sequence = stop_of(result, self.capped)
        return MessageOut(id=self.id, model=self.model, content=builder.blocks(),
                          stop_reason=stop_reason, stop_sequence=stop_sequence,
                          usage=usage_of(result))


class Messages:
    """The Messages routes."""

    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx

    def routes(self, guard: Guard) -> list[Route]:
        """The routes, each endpoint passed through `guard`."""
        return [
            Route("/v1/messages", guard(self.create, generation=True), methods=["POST"]),
            Route("/v1/messages/count_tokens", guard(self.count_tokens), methods=["POST"]),
        ]

    async def _parse(self, request: Request) -> MessagesRequest:
        try:
            req = await self.ctx.parse(request, MessagesRequest)
        except APIError as error:
            raise explain_block_type(error) from None
        self.ctx.check_model(req.model)
        return req

    async def create(self, request: Request) -> Response:
        """Handle one Messages request (the guard maps errors to Anthropic's bodies)."""
        req = await self._parse(request)
        if req.max_tokens is None:
            raise bad_request("max_tokens: required; allowed: the most tokens to generate, at "
                              "least 1", "max_tokens")
        locations: dict[str, str] = {}
        chat = chat_request(req, locations)
        self._note_ignored(req)
        message_id = f"msg_{request_id_of(request, None)}"
        turn = await prepare_turn(self.ctx, chat, message_id, locations=locations)
        turn, capped = self._capped(turn, req.max_tokens)
        reply = _Reply(message_id, self.ctx.response_model(req.model), capped,
                       shows_thinking(req))
        if req.stream:
            return SSEResponse(lambda emit: self._stream(turn, reply, emit), framing=FRAMING)
        builder = ContentBuilder(reply.show_thinking)

        async def feed(piece: ChoiceDelta) -> None:
            builder.feed(piece)

        result = await run_turn(self.ctx, turn, feed, request.receive)
        if result is None:
            return Response(status_code=499)  # the client left; nobody reads this
        builder.finish()
        return json_response(reply.message(builder, result))

    def _capped(self, turn: Turn, max_tokens: int) -> tuple[Turn, bool]:
        """The turn with its output capped at `max_tokens` or the room the context leaves,
        and handed out as deltas (a plain reply is built like a stream); True when the room
        was the smaller."""
        room = self.ctx.max_model_len - turn.num_prompt_tokens
        params = turn.job.params.clone(max_tokens=min(max_tokens, room),
                                       output_kind=RequestOutputKind.DELTA)
        return replace(turn, job=replace(turn.job, params=params)), room < max_tokens

    def _note_ignored(self, req: MessagesRequest) -> None:
        if isinstance(req.thinking, ThinkingEnabled):
            _log_once("/v1/messages: thinking.budget_tokens is checked but does not limit "
                      "the reasoning")
        if req.output_config is not None and req.output_config.effort is not None:
            _log_once("/v1/messages: output_config.effort has no effect")
        reasoning_parser = self.ctx.engine.config.structured_outputs_config.reasoning_parser
        if is_thinking_requested(req) and reasoning_parser is None:
            _log_once("/v1/messages: thinking was asked for, but the server has no "
                      "--reasoning-parser: replies carry no thinking blocks")

    async def _stream(self, turn: Turn, reply: _Reply, emit: Emit) -> None:
        await emit(MessageStart(message=MessageOut(
            id=reply.id, model=reply.model, content=[],
            usage=Usage(input_tokens=turn.num_prompt_tokens))))
        await emit(Ping())
        builder = ContentBuilder(reply.show_thinking)
        keepalive = KeepAlive(emit)

        async def send(piece: ChoiceDelta) -> None:
            await keepalive.stop()
            for event in builder.feed(piece):
                await emit(event)

        failure: Exception | None = None
        result: TurnResult | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keepalive.run)
            try:
                result = await run_turn(self.ctx, turn, send)
            except Exception as exc:  # raised after the nursery, unwrapped
                failure = exc
            await keepalive.stop()
        if failure is not None:
            raise failure
        assert result is not None  # no `receive`: the stream's own watcher sees a disconnect
        for event in [*builder.finish(), *final_events(result, reply.capped)]:
            await emit(event)

    async def count_tokens(self, request: Request) -> Response:
        """`{"input_tokens": N}`: the length of the prompt `/v1/messages` would run."""
        req = await self._parse(request)
        locations: dict[str, str] = {}
        chat = chat_request(req, locations)
        settings = self.ctx.settings
        tools = plan_tools(chat, enable_auto_tool_choice=settings.enable_auto_tool_choice,
                           tool_call_parser=settings.tool_call_parser)
        conversation, images = chat_conversation(chat.messages)
        text = render_chat(self.ctx, conversation,
                           add_generation_prompt=chat.add_generation_prompt,
                           continue_final_message=chat.continue_final_message,
                           template_kwargs=chat.chat_template_kwargs, tools=tools.tools)
        if images:  # counted as the engine would run them: each image's tokens
            token_ids, _ = await render_chat_images(
                self.ctx, text, images, add_special_tokens=chat.add_special_tokens,
                locations=locations)
        else:
            token_ids = await self.ctx.tokenize(text, add_special_tokens=chat.add_special_tokens)
        return json_response(CountTokensOut(input_tokens=len(token_ids)))
