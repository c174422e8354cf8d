"""What the executors and their workers do with each frame they receive, malformed ones included.

Owns the receiving half of the protocol in `wire.py`, shared by both transports (the mp
executor's shm rings and the Ray executor's zmq sockets):

* executor side, `ResponseHandler`: an OUTPUT / RPC_REPLY / STEP_ERROR frame is decoded as a
  `ModelRunnerOutput` / `RpcReply` / `StepError` (the frame's kind names the type) and applied
  to `Pending`; used by each response reader thread;
* worker side, `RequestDecoder`: a STEP / RPC frame is decoded as a `SchedulerOutput` /
  `RpcRequest` (SHUTDOWN carries nothing to decode; the loops handle it).

A frame that does not decode (not msgpack, the wrong type, a bad array, a bad out-of-band buffer
layout, an unknown kind) raises one of `DECODE_ERRORS`; the loops catch exactly those around the
decode, hand the reason to a `DropLog` (a warning, rate-limited: a peer writing garbage must not
flood the log) and go on serving. Dropping a frame is safe for the process that drops it, and
the protocol sees the loss this way:

* a dropped step output (or step error): the step never completes by itself. Rank 0 answers
  steps in order, so the next step's output fails everything in flight with `FrameLostError`
  (`Pending.complete_step`); if no later step follows, only the engine core's
  `--execute-model-timeout-s` turns the wait into a fault (without it, the core waits);
* a dropped RPC reply: the call fails with `FrameLostError` once that rank answers a later call,
  else when its caller's timeout passes (`collective_rpc(timeout=...)`);
* a worker dropping a SchedulerOutput or RpcRequest frame sends nothing back for it: the core
  sees that as a lost answer, as above;
* a stray frame that decodes but answers nothing in flight (a step or a rank that does not
  exist) is dropped the same way.

A malformed frame is never turned into a fault by itself: it may be noise (a frame nobody was
waiting for), and a real loss is caught by the ordering or the timeouts above.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import msgspec

from ringserve.gpu.executor.pending import Pending
from ringserve.gpu.executor.wire import FrameKind, RpcReply, RpcRequest, StepError
from ringserve.gpu.wire import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from ringserve.serial import Buffer, MsgpackDecoder

logger = logging.getLogger(__name__)

# What decoding a malformed frame raises: msgspec's errors (bad msgpack, the wrong type, a bad
# array: `MsgpackDecoder.decode` turns numpy's and torch's complaints into DecodeError) and
# ValueError (a layout `read_buffers` or `split_message` rejects, an unknown kind). TypeError
# too, the set the engine's socket threads catch. Nothing else is caught: anything else is a bug.
DECODE_ERRORS: tuple[type[Exception], ...] = (msgspec.MsgspecError, ValueError, TypeError)

DROP_LOG_INTERVAL_S = 10.0


def kind_name(kind: int) -> str:
    """The `FrameKind` name of `kind` ("unknown kind N" when it is none), for log lines."""
    try:
        return FrameKind(kind).name
    except ValueError:
        return f"unknown kind {kind}"


class DropLog:
    """Counts dropped frames and warns about them: the first at once, then at most one line per
    `interval_s` saying how many were dropped meanwhile.

    Not thread-safe: one per receiving thread.

    Args:
        source: who received the frames, for the log line ("worker rank 1", ...).
        interval_s: the shortest time between two warnings.
    """

    def __init__(self, source: str, interval_s: float = DROP_LOG_INTERVAL_S) -> None:
        self.source = source
        self.count = 0
        self._interval = interval_s
        self._unreported = 0
        self._next_report = 0.0

    def drop(self, reason: object) -> None:
        """Record one dropped frame and why (an exception or a message)."""
        self.count += 1
        now = time.monotonic()
        if now < self._next_report:
            self._unreported += 1
            return
        since = f" ({self._unreported} more dropped since the last report)" if self._unreported else ""
        logger.warning("%s: dropped a malformed frame: %s%s", self.source, reason, since)
        self._unreported = 0
        self._next_report = now + self._interval


class RequestDecoder:
    """Decodes the frames a worker receives (the executor's broadcast ring or socket)."""

    def __init__(self) -> None:
        self._step = MsgpackDecoder(SchedulerOutput)
        self._rpc = MsgpackDecoder(RpcRequest)
        self._grammar = MsgpackDecoder(GrammarOutput)

    def decode(self, kind: int, bufs: Sequence[Buffer],
               ) -> SchedulerOutput | RpcRequest | GrammarOutput:
        """The message of a STEP, RPC or GRAMMAR frame (callers handle SHUTDOWN before).

        Raises:
            DECODE_ERRORS: the frame is malformed or of another kind.
        """
        if kind == FrameKind.STEP:
            return self._step.decode(bufs)
        if kind == FrameKind.RPC:
            return self._rpc.decode(bufs)
        if kind == FrameKind.GRAMMAR:
            return self._grammar.decode(bufs)
        raise ValueError("not a step, a grammar or a call")


class ResponseHandler:
    """Decodes the workers' answers and applies them to the executor's `Pending`.

    One per receiving thread (not thread-safe: it keeps the decoders and the `DropLog`).

    Args:
        pending: the executor's books.
        on_step_error: what a decoded `StepError` does (log it and fail `pending`).
        source: who sends the frames, for the drop log ("worker rank 0", ...).
    """

    def __init__(self, pending: Pending, on_step_error: Callable[[StepError], None],
                 source: str) -> None:
        self._pending = pending
        self._on_step_error = on_step_error
        self._output = MsgpackDecoder(ModelRunnerOutput)
        self._reply = MsgpackDecoder(RpcReply)
        self._error = MsgpackDecoder(StepError)
        self.drops = DropLog(source)

    def decode(self, kind: int, bufs: Sequence[Buffer]) -> ModelRunnerOutput | RpcReply | StepError:
        """The message of an OUTPUT, RPC_REPLY or STEP_ERROR frame.

        Raises:
            DECODE_ERRORS: the frame is malformed or of another kind.
        """
        if kind == FrameKind.OUTPUT:
            return self._output.decode(bufs)
        if kind == FrameKind.RPC_REPLY:
            return self._reply.decode(bufs)
        if kind == FrameKind.STEP_ERROR:
            return self._error.decode(bufs)
        raise ValueError("not a worker's answer")

    def apply(self, message: ModelRunnerOutput | RpcReply | StepError) -> None:
        """Complete the step or call `message` answers; drop it when it answers nothing."""
        if isinstance(message, ModelRunnerOutput):
            if not self._pending.complete_step(message):
                self.drops.drop(f"an output for step {message.step_id}, which is not in flight")
        elif isinstance(message, RpcReply):
            if not self._pending.complete_call(message):
                self.drops.drop(f"a reply to call {message.call_id} from rank {message.rank}, "
                                "which does not exist")
        else:
            self._on_step_error(message)
