"""Running one HTTP request's pooling inputs on the engine, all at once.

`pool_inputs` is a route's whole path for an `input` field (tokenize, check, plan, run);
`run_plans` the running part, which `/score` and `/rerank` call with pairs.

Every engine request of every input (`ringserve.engine.frontend.pooling_inputs.InputPlan`:
one, or one per chunk) is sent through `AsyncLLM.encode` in its own task of one nursery, so
the scheduler batches them with each other and with other clients' requests; the answers come
back in input order, each input's chunks combined. The first failure cancels the rest
(leaving `encode` early aborts their requests in the core) and is raised unwrapped, so the
route maps it to one HTTP error; a client that disconnects cancels them the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import trio
from starlette.requests import Request
from starlette.types import Receive

from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.engine.frontend.pooling_inputs import (
    FloatArray,
    InputPlan,
    PoolingJob,
    plan_inputs,
)
from ringserve.http.context import AppContext, request_id_of
from ringserve.http.pooling.inputs import pooler_of, token_inputs
from ringserve.http.pooling.protocol import inputs_of
from ringserve.http.pooling.responses import response_id
from ringserve.pooling_params import PoolingParams

# The status of a response to a client that disconnected (nobody reads it; nginx's 499).
DISCONNECTED = 499


async def _encode(engine: AsyncLLM, job: PoolingJob, request_id: str,
                  priority: int) -> FloatArray:
    async for output in engine.encode({"prompt_token_ids": job.prompt_token_ids}, job.params,
                                      request_id, priority=priority):
        data: FloatArray = output.outputs.data
        return data
    raise RuntimeError(f"request {request_id!r}: the engine answered nothing")


async def run_plans(engine: AsyncLLM, plans: Sequence[InputPlan], request_id: str, *,
                    priority: int = 0, receive: Receive | None = None,
                    ) -> list[FloatArray] | None:
    """Each input's answer, in input order.

    Args:
        engine: the running engine.
        plans: the inputs' plans.
        request_id: the HTTP request's id; engine requests get `-<input>` (and `.<chunk>`)
            appended.
        priority: the engine requests' priority.
        receive: the request's ASGI receive, once its body has been read: a client
            disconnect then cancels the work.

    Returns:
        The answers, or None when the client disconnected (the requests were aborted).

    Raises:
        The first engine request's error, unwrapped (EngineGenerateError, EngineDeadError,
        QueueOverflowError, ValueError ...).
    """
    engine.check_admission(sum(len(p.jobs) for p in plans),
                           sum(len(j.prompt_token_ids) for p in plans for j in p.jobs))
    results: list[list[FloatArray | None]] = [[None] * len(p.jobs) for p in plans]
    failure: list[Exception] = []
    left = trio.Event()

    async def one(i: int, c: int, job: PoolingJob, scope: trio.CancelScope) -> None:
        rid = f"{request_id}-{i}" if len(plans[i].jobs) == 1 else f"{request_id}-{i}.{c}"
        try:
            results[i][c] = await _encode(engine, job, rid, priority)
        except Exception as exc:  # the first one is raised once the nursery is closed
            if not failure:
                failure.append(exc)
            scope.cancel()

    async with trio.open_nursery() as nursery:
        if receive is not None:
            nursery.start_soon(_watch_disconnect, receive, left, nursery.cancel_scope)
        async with trio.open_nursery() as jobs:
            for i, plan in enumerate(plans):
                for c, job in enumerate(plan.jobs):
                    jobs.start_soon(one, i, c, job, jobs.cancel_scope)
        nursery.cancel_scope.cancel()  # the disconnect watcher
    if failure:
        raise failure[0]
    if left.is_set():
        return None
    answers = []
    for plan, outs in zip(plans, results, strict=True):
        done = [o for o in outs if o is not None]
        answers.append(plan.combine(done))
    return answers


async def _watch_disconnect(receive: Receive, left: trio.Event, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    left.set()
    scope.cancel()


@dataclass(frozen=True)
class Pooled:
    """A request's answers: its response id, one output per input (in input order) and
    the prompt tokens they took."""

    request_id: str
    outputs: list[FloatArray]
    prompt_tokens: int


async def pool_inputs(ctx: AppContext, request: Request, raw: str | list[Any],
                      params: PoolingParams, *, id_prefix: str, given_id: str | None,
                      truncate_prompt_tokens: int | None, add_special_tokens: bool = True,
                      priority: int = 0) -> Pooled | None:
    """A request's `input` (`raw`, any of its four shapes) pooled with `params`.

    Returns:
        The answers, or None when the client disconnected.

    Raises:
        ValueError: a bad input (naming `input`), or as `run_plans`.
    """
    pooler = pooler_of(ctx, "pooling")
    ids = await token_inputs(ctx, inputs_of(raw), field="input",
                             truncate_prompt_tokens=truncate_prompt_tokens,
                             add_special_tokens=add_special_tokens)
    plans = plan_inputs(ids, params, pooler, field="input")
    rid = response_id(id_prefix, request_id_of(request, given_id))
    outputs = await run_plans(ctx.engine, plans, rid, priority=priority,
                              receive=request.receive)
    if outputs is None:
        return None
    return Pooled(rid, outputs, sum(plan.num_tokens for plan in plans))
