"""Pooling requests on the frontend: `AsyncLLM.encode` (mixed into `AsyncLLM`).

A pooling request (an embedding, a classification, a score: `ringserve.pooling_params`) travels
to the core like a generation request that asks for one token it never samples; the core
answers once, with the pooler's output on its last `EngineCoreOutput`, and the output
processor turns that into a `PoolingRequestOutput` (`ringserve.engine.frontend.
output_processor`). A request that fails comes back as a `RequestOutput` whose finish reason
is "error" (or "abort"), raised here as for `generate`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio

from ringserve.engine.errors import (
    RECOVERING_MESSAGE,
    EngineGenerateError,
    EngineRecoveringError,
)
from ringserve.engine.frontend.input_processor import PromptType
from ringserve.outputs import PoolingRequestOutput, RequestOutput
from ringserve.pooling_params import PoolingParams
from ringserve.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["AsyncPoolingMethods", "PoolingCollector", "pooling_sampling_params"]


def pooling_sampling_params() -> SamplingParams:
    """The sampling parameters a pooling request carries for the scheduler's books: one
    token (never sampled), the final output only, no text."""
    return SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY,
                          detokenize=False)


class PoolingCollector:
    """A one-shot mailbox for a pooling request's answer (or its failure)."""

    def __init__(self) -> None:
        self.handle = ""
        self._item: PoolingRequestOutput | RequestOutput | BaseException | None = None
        self._ready = trio.Event()

    def put(self, item: PoolingRequestOutput | RequestOutput | BaseException) -> None:
        """Deposit the answer (the first one wins; an exception always does)."""
        if self._item is None or isinstance(item, BaseException):
            self._item = item
        self._ready.set()

    async def get(self) -> PoolingRequestOutput | RequestOutput:
        """Wait for the answer; raises an exception that was put."""
        await self._ready.wait()
        item = self._item
        assert item is not None  # set before the event
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncPoolingMethods:
    """`encode`, for `AsyncLLM` (a mixin: it uses the engine's `add_request` and abort)."""

    # What the mixin uses of `AsyncLLM` (declared, not stubbed: AsyncLLM defines them).
    _ids: Any
    add_request: Callable[..., Awaitable[Any]]
    _abort_now: Callable[[list[str]], None]

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams,
                     request_id: str | None = None, *, priority: int = 0,
                     data_parallel_rank: int | None = None,
                     ) -> AsyncIterator[PoolingRequestOutput]:
        """Pool one input (vLLM's `AsyncLLM.encode`): yields its one `PoolingRequestOutput`.

        Leaving early, or cancelling the consumer, aborts the request.

        Raises:
            TypeError: `pooling_params` is not a `PoolingParams`.
            EngineDeadError: the engine died.
            EngineGenerateError: this request failed in the engine (the message says why).
            ValueError, QueueOverflowError, MaxQueuedTokensError: as `add_request`.
        """
        if not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params: expected a PoolingParams, got "
                            f"{type(pooling_params).__name__}")
        rid = request_id if request_id is not None else f"pool-{next(self._ids)}"
        collector = PoolingCollector()
        await self.add_request(rid, prompt, pooling_sampling_params(), priority=priority,
                               data_parallel_rank=data_parallel_rank,
                               pooling_params=pooling_params, collector=collector)
        finished = False
        try:
            output = await collector.get()
            finished = True
            if isinstance(output, RequestOutput):
                completion = output.outputs[0] if output.outputs else None
                reason = completion.stop_reason if completion is not None else None
                if reason == RECOVERING_MESSAGE:
                    raise EngineRecoveringError(f"request {rid!r}: {RECOVERING_MESSAGE}")
                finish = completion.finish_reason if completion is not None else "abort"
                if finish == "abort":
                    raise EngineGenerateError(f"request {rid!r} was aborted")
                raise EngineGenerateError(f"request {rid!r} failed: {reason}")
            yield output
        finally:
            if not finished:
                self._abort_now([collector.handle])
