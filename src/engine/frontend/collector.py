"""The per-request output slot between the output handler and a `generate()` consumer.

One `RequestOutputCollector` per request, on trio. The output handler `put`s without ever
waiting; while the consumer lags, deltas are merged into the single slot (text and token ids
appended, logprobs extended) and cumulative or final outputs replace the slot, so a slow client
costs memory proportional to its own backlog and never blocks the handler or other requests.
An exception put in the slot (engine death, a failed request) is raised by the next `get`.
"""

from __future__ import annotations

import trio

from ringserve.outputs import CompletionOutput, RequestOutput
from ringserve.sampling_params import RequestOutputKind


class RequestOutputCollector:
    """A single-slot, merging mailbox for one request's outputs.

    Args:
        output_kind: how consecutive outputs combine (DELTA merges, others replace).
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self._kind = output_kind
        # The request's internal id (set when it is admitted): what aborts exactly it.
        self.handle = ""
        self._slot: RequestOutput | BaseException | None = None
        self._ready = trio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Deposit an output (merged with one not yet taken) or an exception; never waits."""
        slot = self._slot
        if slot is None or isinstance(item, BaseException) or isinstance(slot, BaseException):
            if not isinstance(slot, BaseException):
                self._slot = item
        elif self._kind is RequestOutputKind.DELTA:
            _merge_delta(slot, item)
        else:
            self._slot = item
        self._ready.set()

    def get_nowait(self) -> RequestOutput | None:
        """The pending output, if any (raises a pending exception)."""
        slot = self._slot
        if slot is None:
            return None
        self._slot = None
        self._ready = trio.Event()
        if isinstance(slot, BaseException):
            raise slot
        return slot

    async def get(self) -> RequestOutput:
        """Wait for the next (merged) output; raises an exception that was put."""
        while True:
            item = self.get_nowait()
            if item is not None:
                return item
            await self._ready.wait()


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for completion in new.outputs:
        old = by_index.get(completion.index)
        if old is None:
            into.outputs.append(completion)
            by_index[completion.index] = completion
        else:
            _merge_completion(old, completion)
    into.finished = new.finished
    into.metrics = new.metrics
    into.num_cached_tokens = new.num_cached_tokens
    if into.prompt_logprobs is None:
        into.prompt_logprobs = new.prompt_logprobs


def _merge_completion(old: CompletionOutput, new: CompletionOutput) -> None:
    old.text += new.text
    old.token_ids = old.token_ids + new.token_ids
    if new.logprobs is not None:
        old.logprobs = (old.logprobs or []) + new.logprobs
    old.cumulative_logprob = new.cumulative_logprob
    old.finish_reason = new.finish_reason
    old.stop_reason = new.stop_reason
