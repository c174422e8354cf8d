"""Errors the executors raise to the engine core: all of them are engine faults.

A step or utility call that cannot complete because a worker died (`WorkerDiedError`), a worker
raised (`WorkerError`), its answer was lost to a malformed frame (`FrameLostError`), it did not
answer a call in time (`WorkerTimeoutError`), or the executor was shut down under it
(`ExecutorShutdownError`). The engine core maps any of them to
its fault handling (fail in-flight requests, report unhealthy).
"""

from __future__ import annotations

from ringserve.errors import RingserveError


class ExecutorError(RingserveError, RuntimeError):
    """Base class: the executor cannot run steps any more."""


class WorkerDiedError(ExecutorError):
    """A worker process exited while the executor needed it.

    Attributes:
        rank: the worker's TP rank.
        exitcode: its exit status (negative: killed by that signal), or None if unknown.
    """

    def __init__(self, rank: int, exitcode: int | None) -> None:
        self.rank = rank
        self.exitcode = exitcode
        if exitcode is None:
            how = "exited"
        elif exitcode < 0:
            how = f"was killed by signal {-exitcode}"
        else:
            how = f"exited with status {exitcode}"
        super().__init__(f"worker rank {rank} (ringserve::Worker_TP{rank}) {how}")


class WorkerError(ExecutorError):
    """A worker raised inside a step or a utility call; the message carries the worker's.

    Attributes:
        rank: the rank that raised.
        worker_traceback: the worker-side traceback, when it sent one.
    """

    def __init__(self, rank: int, message: str, worker_traceback: str = "") -> None:
        self.rank = rank
        self.worker_traceback = worker_traceback
        super().__init__(message)


class FrameLostError(ExecutorError):
    """A worker's answer to a step or call never arrived: its frame was malformed and dropped.

    Each rank answers in the order it was asked, so an answer to a later step (or call) proves
    that the earlier one's frame was lost.

    Attributes:
        rank: the rank whose answer was lost.
    """

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        super().__init__(message)


class WorkerTimeoutError(ExecutorError):
    """The workers did not answer a call between steps in time (a hung worker)."""


class ExecutorShutdownError(ExecutorError):
    """The executor was shut down while a step or call was pending."""
