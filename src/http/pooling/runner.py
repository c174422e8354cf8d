"""Running one HTTP request's pooling inputs on the engine, all at once.

Every engine request of every input (`ringserve.engine.frontend.pooling_inputs.InputPlan`:
one, or one per chunk) is sent through `AsyncLLM.encode` in its own task of one nursery, so
the scheduler batches them with each other and with other clients' requests; the answers come
back in input order, each input's chunks combined. The first failure cancels the rest
(leaving `encode` early aborts their requests in the core) and is raised unwrapped, so the
route maps it to one HTTP error; a client that disconnects cancels them the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio
from starlette.types import Receive

from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.engine.frontend.pooling_inputs import FloatArray, InputPlan, PoolingJob

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
