"""The multiprocess executor's books: steps and utility calls in flight, and the first fault.

Owned by `multiproc.MultiprocExecutor`: the engine-core thread records a step or call before its
frame goes into the broadcast ring; the per-rank response reader threads complete them; a
worker's death or error fails every entry at once (`fail`), and from then on every new entry is
failed on arrival. Thread-safe (one lock); futures are completed outside it, so a callback that
re-enters the executor cannot deadlock. Imports no torch and no rings.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

from ringserve.gpu.executor.errors import WorkerError
from ringserve.gpu.executor.wire import RpcReply
from ringserve.gpu.wire import ModelRunnerOutput


class _Call:
    """One utility call: a reply from every rank, then one future of the values in rank order."""

    def __init__(self, world_size: int) -> None:
        self.future: Future[list[Any]] = Future()
        self.replies: list[RpcReply | None] = [None] * world_size


class Pending:
    """Steps (in submission order) and utility calls (by id) awaiting their workers.

    Args:
        world_size: the number of ranks that answer every utility call.
    """

    def __init__(self, world_size: int) -> None:
        self._world = world_size
        self._lock = threading.Lock()
        self._steps: deque[tuple[int, Future[ModelRunnerOutput]]] = deque()
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self.failure: BaseException | None = None

    def add_step(self, step_id: int) -> Future[ModelRunnerOutput]:
        """A future for step `step_id`, queued behind the steps already in flight."""
        future: Future[ModelRunnerOutput] = Future()
        with self._lock:
            failure = self.failure
            if failure is None:
                self._steps.append((step_id, future))
        if failure is not None:
            future.set_exception(failure)
        return future

    def drop_last_step(self, future: Future[ModelRunnerOutput]) -> None:
        """Forget the newest step (its frame could not be sent)."""
        with self._lock:
            if self._steps and self._steps[-1][1] is future:
                self._steps.pop()

    def complete_step(self, output: ModelRunnerOutput) -> None:
        """Complete the oldest step with rank 0's output (ignored once failed).

        Raises:
            RuntimeError: the output answers another step than the oldest one (a protocol bug).
        """
        with self._lock:
            if not self._steps:
                return  # its future was already failed
            step_id, future = self._steps[0]
            if step_id != output.step_id:
                raise RuntimeError(
                    f"worker rank 0 answered step {output.step_id}, expected step {step_id}"
                )
            self._steps.popleft()
        future.set_result(output)

    def add_call(self) -> tuple[int, Future[list[Any]]]:
        """A new call id and the future of every rank's value."""
        call = _Call(self._world)
        with self._lock:
            failure = self.failure
            call_id = next(self._ids)
            if failure is None:
                self._calls[call_id] = call
        if failure is not None:
            call.future.set_exception(failure)
        return call_id, call.future

    def drop_call(self, call_id: int) -> None:
        """Forget a call (sent in vain, or its caller stopped waiting)."""
        with self._lock:
            self._calls.pop(call_id, None)

    def complete_call(self, reply: RpcReply) -> None:
        """Record one rank's reply; the last one completes the call's future."""
        with self._lock:
            call = self._calls.get(reply.call_id)
            if call is None or not 0 <= reply.rank < self._world:
                return
            call.replies[reply.rank] = reply
            replies = [r for r in call.replies if r is not None]
            if len(replies) < self._world:
                return
            del self._calls[reply.call_id]
        errors = [r for r in replies if r.error is not None]
        if errors:
            first = errors[0]
            call.future.set_exception(WorkerError(first.rank, f"worker rank {first.rank}: {first.error}"))
        else:
            call.future.set_result([r.value for r in replies])

    def fail(self, exc: BaseException) -> None:
        """Record the first fault and fail every step and call in flight with it."""
        with self._lock:
            if self.failure is None:
                self.failure = exc
            failure = self.failure
            steps: list[Future[Any]] = [future for _, future in self._steps]
            calls: list[Future[Any]] = [call.future for call in self._calls.values()]
            self._steps.clear()
            self._calls.clear()
        for future in [*steps, *calls]:
            if not future.done():
                future.set_exception(failure)
