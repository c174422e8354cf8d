"""The routes of OpenAI's Responses API: `POST /v1/responses` and, on stored responses,
`GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`
and `POST /v1/responses/{id}/cancel`.

A request is checked and translated (`responses_input`) onto the chat route's machinery
(`turn.prepare_turn`: every 400 and 503 comes before any response starts, nothing reaches the
core), then answered three ways: plainly, as a stream of events (`responses_stream`), or, with
`background: true`, at once as `queued` while the turn runs in the server's background
nursery (`ServerState.background`; it counts itself in flight, so a drain waits for it);
`GET` polls it and `cancel` cancels its task, which aborts the engine request. With `store`
(the default, as OpenAI's) the finished response and its whole input go into the bounded
`ResponseStore`, from which `previous_response_id` continues the conversation: its input
items and output items (function calls included) come before the new input. An unknown,
deleted, expired or evicted id is a 404 naming it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ringserve.http.agents.responses_input import (
    chat_request,
    check_fields,
    new_items,
    parse_request,
    responses_error,
    tools_of,
)
from ringserve.http.agents.responses_protocol import (
    Deleted,
    FunctionToolIn,
    FunctionToolOut,
    Item,
    ItemList,
    NamedToolChoiceOut,
    ReasoningConfig,
    ResponseObject,
    ResponsesRequest,
    StreamEvent,
    TextFormatOut,
    TextOut,
    new_id,
)
from ringserve.http.agents.responses_store import ResponseStore, StoredResponse
from ringserve.http.agents.responses_stream import ResponseRun
from ringserve.http.agents.turn import Turn, prepare_turn
from ringserve.http.context import AppContext, Guard
from ringserve.http.errors import APIError, bad_request
from ringserve.http.responses import json_response
from ringserve.http.streaming import Emit, Framing, SSEResponse, named_event

logger = logging.getLogger(__name__)


MAX_PAGE = 100
DEFAULT_PAGE = 20



def _event(body: Any) -> bytes:
    event: StreamEvent = body
    return named_event(event.type, event)


# The producer ends every stream with its own response.failed, so an error needs no event.
FRAMING = Framing(event=_event, error=lambda error: b"", done=b"")

_effort_noted = False


def _note_effort(reasoning: ReasoningConfig | None) -> None:
    """Say once in the log that `reasoning.effort` changes nothing."""
    global _effort_noted
    if reasoning is None or reasoning.effort is None or _effort_noted:
        return
    _effort_noted = True
    logger.info("reasoning.effort=%r has no effect on /v1/responses: the model reasons as its "
                "chat template and --reasoning-parser say (said once)", reasoning.effort)


@contextmanager
def _fields_named_for(req: ResponsesRequest) -> Iterator[None]:
    """Errors of the shared chat code raised inside, with their fields named as `req`
    spells them (`responses_error`)."""
    try:
        yield
    except Exception as exc:
        error = responses_error(exc, req)
        if error is None:
            raise
        raise error from None


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No response with id `{response_id}` (unknown, deleted or evicted "
                         "from the response store)", param)


@dataclass
class _Background:
    """A background response while its turn runs."""

    run: ResponseRun
    req: ResponsesRequest
    conversation: list[Item]
    response: ResponseObject
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)


def _echo(req: ResponsesRequest, tools: list[FunctionToolIn]) -> dict[str, Any]:
    """The request fields the response object repeats."""
    choice = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    return {
        "tool_choice": (choice if isinstance(choice, str)
                        else "auto" if choice is None
                        else NamedToolChoiceOut(name=str(choice.get("name")))),
        "tools": [FunctionToolOut(name=t.name, parameters=t.parameters, strict=t.strict,
                                  description=t.description) for t in tools],
        "text": TextOut(format=TextFormatOut(type="text") if fmt is None else TextFormatOut(
            type=fmt.type, name=fmt.name, schema=fmt.schema, strict=fmt.strict,
            description=fmt.description), verbosity=req.text.verbosity if req.text else None),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning or ReasoningConfig(), "user": req.user,
        "background": bool(req.background), "store": req.store is not False,
    }


class Responses:
    """The Responses API's routes and their store of responses and background runs."""

    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx
        settings = ctx.settings
        self.store = ResponseStore(settings.responses_store_max_entries,
                                   settings.responses_store_ttl)
        self.running: dict[str, _Background] = {}

    def routes(self, guard: Guard) -> list[Route]:
        """The routes, each behind the app's `guard`."""
        return [
            Route("/v1/responses", guard(self.create, generation=True), methods=["POST"]),
            Route("/v1/responses/{response_id}", guard(self.retrieve), methods=["GET"]),
            Route("/v1/responses/{response_id}", guard(self.delete), methods=["DELETE"]),
            Route("/v1/responses/{response_id}/input_items", guard(self.input_items),
                  methods=["GET"]),
            Route("/v1/responses/{response_id}/cancel", guard(self.cancel), methods=["POST"]),
        ]

    async def create(self, request: Request) -> Response:
        """`POST /v1/responses` (the app's guard maps errors to responses)."""
        ctx = self.ctx
        req = await parse_request(ctx, request)
        ctx.check_model(req.model)
        check_fields(req)
        self._check_background(req)
        _note_effort(req.reasoning)
        prior = self._previous(req.previous_response_id)
        conversation = [*prior, *new_items(req, prior)]
        tools = tools_of(req)
        response_id = new_id("resp")
        with _fields_named_for(req):
            locations: dict[str, str] = {}
            chat = chat_request(req, conversation, tools, stream=bool(req.stream),
                                new_from=len(prior), locations=locations)
            turn = await prepare_turn(ctx, chat, response_id, locations=locations)
        base = self._base(req, response_id, turn, tools)
        if req.background:
            return self._start_background(_Background(ResponseRun(ctx, turn, base), req,
                                                      conversation, base))
        if req.stream:
            return SSEResponse(lambda emit: self._stream(req, turn, base, conversation, emit),
                               framing=FRAMING)
        with _fields_named_for(req):
            final = await ResponseRun(ctx, turn, base).run(request.receive)
        if final is None:
            return Response(status_code=499)  # the client left; nobody reads this
        if req.store is not False:
            self.store.put(StoredResponse(final, conversation))
        return json_response(final)

    def _check_background(self, req: ResponsesRequest) -> None:
        if not req.background:
            return
        if req.store is False:
            raise bad_request("background: needs store=true (a background response is "
                              "fetched from the store)", "background")
        if self.store.max_entries == 0:
            raise bad_request("background: needs the response store, which this server keeps "
                              "empty (--responses-store-max-entries 0)", "background")
        if req.stream:
            raise bad_request("background: cannot be combined with stream=true; poll GET "
                              "/v1/responses/{id} instead", "background")
        if self.ctx.state.background is None:
            raise APIError(503, "background: this server runs no background responses",
                           "background")

    def _previous(self, response_id: str | None) -> list[Item]:
        """The conversation a continuation starts from (empty without one)."""
        if response_id is None:
            return []
        if response_id in self.running:
            raise bad_request(f"previous_response_id: response `{response_id}` is still in "
                              "progress; allowed: a finished response", "previous_response_id")
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id, "previous_response_id")
        return entry.conversation

    def _base(self, req: ResponsesRequest, response_id: str, turn: Turn,
              tools: list[FunctionToolIn]) -> ResponseObject:
        """The response object as it starts."""
        params = turn.job.params
        return ResponseObject(
            id=response_id, created_at=int(time.time()),
            status="queued" if req.background else "in_progress",
            model=self.ctx.response_model(req.model), output=[],
            temperature=params.temperature, top_p=params.top_p, **_echo(req, tools))

    async def _stream(self, req: ResponsesRequest, turn: Turn, base: ResponseObject,
                      conversation: list[Item], emit: Emit) -> None:
        run = ResponseRun(self.ctx, turn, base, emit)
        store = req.store is not False
        try:
            final = await run.run()
        except Exception as exc:
            error = responses_error(exc, req)
            failed = await run.fail(error or APIError(500, f"Internal error: {exc!r}"))
            if store:
                self.store.put(StoredResponse(failed, conversation))
            if error is None:
                raise  # a bug: the client got response.failed; the server logs the traceback
            return
        if final is not None and store:
            self.store.put(StoredResponse(final, conversation))

    def _start_background(self, job: _Background) -> Response:
        nursery = self.ctx.state.background
        assert nursery is not None  # _check_background
        self.running[job.response.id] = job
        self.ctx.state.enter()
        try:
            nursery.start_soon(self._background, job)
        except BaseException:
            del self.running[job.response.id]
            self.ctx.state.leave()
            raise
        return json_response(job.response)

    async def _background(self, job: _Background) -> None:
        """Run a background response; a cancel (its own, or the server's stop) leaves it
        `cancelled` in the store."""
        try:
            with job.scope:
                job.response = msgspec.structs.replace(job.response, status="in_progress")
                job.response = await self._run_background(job)
        finally:
            if job.response.status in ("queued", "in_progress"):
                job.response = msgspec.structs.replace(job.response, status="cancelled",
                                                       completed_at=int(time.time()))
            del self.running[job.response.id]
            self.store.put(StoredResponse(job.response, job.conversation))
            self.ctx.state.leave()
            job.done.set()

    async def _run_background(self, job: _Background) -> ResponseObject:
        try:
            final = await job.run.run()
        except Exception as exc:
            error = responses_error(exc, job.req)
            if error is None:
                # Nobody waits on this task to re-raise to: its traceback goes to the log,
                # as a plain request's bug would, and the response says it failed.
                logger.exception("background response %s failed", job.response.id)
            return await job.run.fail(error or APIError(500, f"Internal error: {exc!r}"))
        assert final is not None  # only a plain request's disconnect ends it early
        return final

    def _lookup(self, response_id: str) -> tuple[ResponseObject, list[Item]]:
        job = self.running.get(response_id)
        if job is not None:
            return job.response, job.conversation
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id, "response_id")
        return entry.response, entry.input_items

    async def retrieve(self, request: Request) -> Response:
        """`GET /v1/responses/{id}`."""
        response, _ = self._lookup(request.path_params["response_id"])
        return json_response(response)

    async def delete(self, request: Request) -> Response:
        """`DELETE /v1/responses/{id}` (a running background response is cancelled first)."""
        response_id = request.path_params["response_id"]
        job = self.running.get(response_id)
        if job is not None:
            await self._cancel(job)
        if not self.store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return json_response(Deleted(id=response_id))

    async def cancel(self, request: Request) -> Response:
        """`POST /v1/responses/{id}/cancel`: a background response's run stops (its engine
        request is aborted) and it is `cancelled`; a finished one is answered as it is."""
        response_id = request.path_params["response_id"]
        job = self.running.get(response_id)
        if job is not None:
            await self._cancel(job)
            return json_response(job.response)
        response, _ = self._lookup(response_id)
        if not response.background:
            raise bad_request(f"response_id: `{response_id}` was not created with background="
                              "true; only background responses can be cancelled",
                              "response_id")
        return json_response(response)

    async def _cancel(self, job: _Background) -> None:
        job.scope.cancel()
        await job.done.wait()

    async def input_items(self, request: Request) -> Response:
        """`GET /v1/responses/{id}/input_items?after=&limit=&order=`: OpenAI's list page of
        the response's input items (`order` desc by default, as OpenAI's)."""
        response_id = request.path_params["response_id"]
        _, items = self._lookup(response_id)
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"order: got {order!r}, allowed: asc, desc", "order")
        limit_text = query.get("limit", str(DEFAULT_PAGE))
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_PAGE:
            raise bad_request(f"limit: got {limit_text!r}, allowed: an integer from 1 to "
                              f"{MAX_PAGE}", "limit")
        ordered = items if order == "asc" else items[::-1]
        start = 0
        after = query.get("after")
        if after is not None:
            ids = [item.id for item in ordered]
            if after not in ids:
                raise bad_request(f"after: no input item `{after}` in response "
                                  f"`{response_id}`", "after")
            start = ids.index(after) + 1
        page = ordered[start:start + int(limit_text)]
        return json_response(ItemList(
            data=page, first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=start + len(page) < len(ordered)))
