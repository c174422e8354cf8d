"""`ringserve.http.pooling.runner.run_plans` on a fake engine: every request runs at once and
the answers come back in input order (chunks combined), the first failure cancels the rest
and is raised unwrapped, a client disconnect cancels everything, and the admission limits
see the whole request first."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import trio

from ringserve.engine.errors import EngineGenerateError, QueueOverflowError
from ringserve.engine.frontend.pooling_inputs import InputPlan, PoolingJob
from ringserve.http.pooling.runner import run_plans
from ringserve.outputs import PoolingOutput, PoolingRequestOutput
from ringserve.pooling_params import PoolingParams

PARAMS = PoolingParams()


class FakeEngine:
    """Answers `[first id, length]` after `first id` milliseconds; an input whose first id
    is 0 fails; 9 never answers. Records the ids it was asked for and the ones cancelled."""

    def __init__(self, max_requests: int = 100) -> None:
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.admitted: tuple[int, int] | None = None
        self.max_requests = max_requests

    def check_admission(self, num_requests: int, num_tokens: int) -> None:
        if num_requests > self.max_requests:
            raise QueueOverflowError(f"{num_requests} requests")
        self.admitted = (num_requests, num_tokens)

    async def encode(self, prompt: Any, params: PoolingParams, request_id: str, *,
                     priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:
        ids = prompt["prompt_token_ids"]
        self.started.append(request_id)
        try:
            await trio.sleep(3600 if ids[0] == 9 else ids[0] / 1000)
        except trio.Cancelled:
            self.cancelled.append(request_id)
            raise
        if ids[0] == 0:
            raise EngineGenerateError(f"request {request_id!r} failed: boom")
        data = np.array([ids[0], len(ids)], np.float32)
        yield PoolingRequestOutput(request_id, PoolingOutput(data), ids)


def plan(*chunks: list[int]) -> InputPlan:
    jobs = tuple(PoolingJob(c, PARAMS) for c in chunks)
    return InputPlan(jobs, sum(len(c) for c in chunks), chunked=len(chunks) > 1)


async def test_answers_in_input_order_with_chunks_combined() -> None:
    engine = FakeEngine()
    plans = [plan([30, 1]), plan([5, 1, 1, 1], [1, 1]), plan([2])]
    out: Any = await run_plans(engine, plans, "r")
    assert [o.tolist() for o in out[::2]] == [[30, 2], [2, 1]]
    # Chunks [5, 4] and [1, 2], weighted by their lengths 4 and 2.
    np.testing.assert_allclose(out[1], [(5 * 4 + 1 * 2) / 6, (4 * 4 + 2 * 2) / 6], rtol=1e-6)
    assert sorted(engine.started) == ["r-0", "r-1.0", "r-1.1", "r-2"]
    assert engine.admitted == (4, 9)


async def test_the_first_failure_cancels_the_rest_and_is_raised_unwrapped() -> None:
    engine = FakeEngine()
    with pytest.raises(EngineGenerateError, match="'r-1' failed: boom"):
        await run_plans(engine, [plan([9]), plan([0]), plan([9])], "r")
    assert sorted(engine.cancelled) == ["r-0", "r-2"]


async def test_admission_limits_see_the_whole_request() -> None:
    engine = FakeEngine(max_requests=2)
    with pytest.raises(QueueOverflowError):
        await run_plans(engine, [plan([1]), plan([1], [1])], "r")
    assert engine.started == []


async def test_a_client_disconnect_cancels_everything() -> None:
    engine = FakeEngine()
    gone = trio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async with trio.open_nursery() as nursery:
        result: list[Any] = []

        async def run() -> None:
            result.append(await run_plans(engine, [plan([9]), plan([9])], "r",
                                          receive=receive))

        nursery.start_soon(run)
        await trio.sleep(0.01)
        gone.set()
    assert result == [None]
    assert sorted(engine.cancelled) == ["r-0", "r-1"]
