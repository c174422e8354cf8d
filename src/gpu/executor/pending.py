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

from ringserve.gpu.executor.errors import FrameLostError, WorkerError
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

    def complete_step(self, output: ModelRunnerOutput) -> bool:
        """Complete the step `output` answers with rank 0's output.

        Rank 0 answers steps in submission order, so an answer to a later step than the oldest
        one in flight means the oldest's output frame was lost (malformed, dropped): that is an
        engine fault, and everything in flight fails with `FrameLostError`.

        Returns:
            False when no step in flight has the output's id (a stray frame: nothing changed);
            True otherwise (also once failed: a late answer to a failed step is ignored).
        """
        with self._lock:
            if self.failure is not None:
                return True
            steps = self._steps
            if not steps:
                return False
            oldest, future = steps[0]
            if oldest == output.step_id:
                steps.popleft()
            elif all(step_id != output.step_id for step_id, _ in steps):
                return False
        if oldest == output.step_id:
            future.set_result(output)
        else:
            self.fail(FrameLostError(0, f"worker rank 0 answered step {output.step_id} before "
                                        f"step {oldest}: the output of step {oldest} was lost "
                                        "(a malformed frame was dropped)"))
        return True

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

    def complete_call(self, reply: RpcReply) -> bool:
        """Record one rank's reply; the last one completes the call's future.

        A rank answers calls in the order they were made, so its reply to a call also means
        that its replies to earlier calls still waiting for it were lost (malformed frames,
        dropped): those calls fail with `FrameLostError`. A reply to a call nobody waits for
        (its caller timed out, or a stray frame) is ignored.

        Returns:
            False when the reply names a rank that does not exist (nothing changed), else True.
        """
        if not 0 <= reply.rank < self._world:
            return False
        rank = reply.rank
        with self._lock:
            call = self._calls.get(reply.call_id)
            if call is None:
                return True
            lost = [(call_id, earlier) for call_id, earlier in self._calls.items()
                    if call_id < reply.call_id and earlier.replies[rank] is None]
            for call_id, _ in lost:
                del self._calls[call_id]
            done = self._record(call, reply)
        for call_id, earlier in lost:
            earlier.future.set_exception(FrameLostError(
                rank, f"worker rank {rank} answered call {reply.call_id} before call {call_id}: "
                      f"its reply to call {call_id} was lost (a malformed frame was dropped)"))
        if done:
            self._finish(call)
        return True

    def _record(self, call: _Call, reply: RpcReply) -> bool:
        """Store `reply` (the lock is held); whether the call now has every rank's reply."""
        call.replies[reply.rank] = reply
        if any(r is None for r in call.replies):
            return False
        del self._calls[reply.call_id]
        return True

    @staticmethod
    def _finish(call: _Call) -> None:
        replies = [r for r in call.replies if r is not None]
        errors = [r for r in replies if r.error is not None]
        if errors:
            first = errors[0]
            call.future.set_exception(WorkerError(first.rank, f"worker rank {first.rank}: {first.error}"))
        else:
            call.future.set_result([r.value for r in replies])

    def idle(self) -> bool:
        """No fault, and no step or call waiting for a worker."""
        with self._lock:
            return self.failure is None and not self._steps and not self._calls

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
