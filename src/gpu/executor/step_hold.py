"""Steps already queued for a worker that a pause makes pointless: skip them.

With async scheduling the engine core keeps two steps in flight: the one a worker runs and the
next, already in the broadcast ring. A `pause("keep")` or `pause("abort")` that arrives
meanwhile is only read by the core's busy loop once the running step is back, and by then the
worker has started the queued one: the pause (and a weight update after it) waited for two
steps, the second of which computes tokens for requests that are about to be frozen,
aborted or recomputed with new weights. So the core's input thread raises a flag in shared
memory as soon as such a pause arrives (`StepHold`, held by the multiprocess executor; the
in-process executor keeps a plain attribute its step thread reads); a worker that reads a
step while the flag is up does not run it: it applies the step's
bookkeeping (new requests, finished and preempted ones, block tables) and answers at once
with an output marked `skipped`, listing the requests that would have sampled. The core then
takes the step back (`Scheduler.rollback_step`) and the requests are scheduled again exactly
as they were, so their tokens and KV are what they would have been without the pause.

The core schedules nothing while the flag is up (`EngineCore.hold_for_pause`), so every step
in flight at that moment comes back, run or skipped, before another one is sent; a worker
that skipped one therefore never runs a step scheduled after it. The flag comes down once
none is in flight, before the pause itself is applied.

The captured decode step also reads the flag between its layers (`HoldFlag.address`), and so
does an eager step (prefill chunks, mixed batches: `decode_capture.abort_check` between the
model's layers): a step already running when the pause comes ends at the next layer and is
answered as skipped too (the KV it wrote for its positions is rewritten when it runs again).

Only where one worker decides alone: a single TP rank (ranks would read the flag at different
moments and disagree; their forwards meet in collectives) and no lockstep data parallelism
(the other cores' forwards wait for this one's expert exchanges). Elsewhere `StepHold.for_config`
gives None (`steps_may_be_skipped` False) and steps run as before.
"""

from __future__ import annotations

import contextlib
import ctypes

from ringserve.config import EngineConfig
from ringserve.shm.segment import Segment

_SIZE = 64


def steps_may_be_skipped(config: EngineConfig) -> bool:
    """True where one worker decides alone whether to skip a step (see the module
    docstring)."""
    parallel = config.parallel_config
    return parallel.tensor_parallel_size == 1 and not parallel.lockstep


class StepHold:
    """The core's end of the flag: a one-byte shared-memory segment the worker maps."""

    def __init__(self) -> None:
        self._segment: Segment | None = Segment.create("hold", _SIZE)

    @staticmethod
    def for_config(config: EngineConfig) -> StepHold | None:
        """A flag when steps of this deployment may be skipped (see the module docstring)."""
        return StepHold() if steps_may_be_skipped(config) else None

    @property
    def name(self) -> str:
        """The segment's name, for the worker's spec ("" once closed)."""
        return "" if self._segment is None else self._segment.name

    def set(self, up: bool) -> None:
        """Raise (workers skip the steps they read from now on) or lower the flag."""
        segment = self._segment
        if segment is not None:
            with contextlib.suppress(ValueError):  # unmapped by a shutdown meanwhile
                segment.mapping[0] = 1 if up else 0

    def unlink(self) -> None:
        """Remove the name once the workers have mapped it (idempotent)."""
        if self._segment is not None:
            self._segment.unlink()

    def close(self) -> None:
        """Unmap and unlink the segment (idempotent)."""
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.close()


class HoldFlag:
    """A worker's end of the flag (read before each step).

    Args:
        name: the segment's name from the worker's spec.
    """

    def __init__(self, name: str) -> None:
        self._segment = Segment.attach(name)
        self._mapping = self._segment.mapping
        # A view of the byte, for its address (released before the unmap).
        self._byte: ctypes.c_ubyte | None = ctypes.c_ubyte.from_buffer(self._mapping)

    @property
    def address(self) -> int:
        """The flag byte's address in this process (the captured decode step reads it
        between layers and ends the step there: `ModelRunner.abort_flag`)."""
        assert self._byte is not None, "the flag is closed"
        return ctypes.addressof(self._byte)

    def is_up(self) -> bool:
        """True while the core asks for the steps read now to be skipped."""
        return self._mapping[0] != 0

    def close(self) -> None:
        """Unmap the segment (nothing may read the address afterwards)."""
        self._byte = None
        self._segment.close()
