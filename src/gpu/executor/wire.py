"""What crosses between the multiprocess executor and its worker processes, and how.

Owns the boundary between `multiproc.py` (the engine-core side) and `worker_proc.py` (each
worker process): the start-up spec a worker reads from its stdin, the frame kinds on the rings,
the utility-call (RPC) messages, the step-error message, and the layout of one ring frame that
carries a message with out-of-band buffers. No pickle: everything is msgspec msgpack through
`ringserve.serial`, so a peer that can write a frame can describe data, never run code.

Rings (all created by the executor, attached by the workers):

* one broadcast ring, executor -> every worker (reader ``i`` is TP rank ``i``): frames of kind
  `FrameKind.STEP` (a `SchedulerOutput`), `FrameKind.RPC` (an `RpcRequest`) and
  `FrameKind.SHUTDOWN` (empty), in one order that every rank sees;
* one SPSC response ring per rank, worker -> executor: `FrameKind.OUTPUT` (rank 0's
  `ModelRunnerOutput`), `FrameKind.RPC_REPLY` (an `RpcReply`, every rank answers every call)
  and `FrameKind.STEP_ERROR` (a `StepError`, from whichever rank raised).

Frame layout of a multi-buffer message (`write_message` / `read_buffers`); all integers
little-endian, every buffer starts 8-byte aligned (the ring's payloads are 8-byte aligned)::

    u32 n_buffers | u32 0 | u64 len_0 | ... | u64 len_{n-1} | buf_0 pad8 | ... | buf_{n-1}

Buffer 0 is the msgpack body; the rest are the arrays `MsgpackEncoder` moved out of band.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from typing import Any

import msgspec

from ringserve.config import EngineConfig
from ringserve.serial import Buffer
from ringserve.shm import RingWriter

_COUNT = struct.Struct("<II")
_LEN = struct.Struct("<Q")


class FrameKind(enum.IntEnum):
    """The `kind` of a ring frame (see the module docstring for which ring carries which)."""

    STEP = 1
    RPC = 2
    SHUTDOWN = 3
    OUTPUT = 4
    RPC_REPLY = 5
    STEP_ERROR = 6
    GRAMMAR = 7  # executor -> workers: the bitmask of a step that waits for it


class WorkerSpec(msgspec.Struct, frozen=True):
    """Everything a worker process needs to start, sent as msgpack on its stdin.

    Attributes:
        config: the engine configuration.
        rank: the worker's TP rank (also its reader index on the broadcast ring).
        local_rank: the CUDA device index on this host.
        distributed_init_method: the torch.distributed init URL (TP > 1).
        sched_ring: the broadcast ring's segment name.
        out_ring: this rank's response ring's segment name.
        parent_pid: the executor's pid (the worker exits if its parent is not this pid).
        lifeline_fd: the inherited read end of the lifeline pipe.
        null_model: serve a `NullWorker` (engine-overhead benchmark) instead of the model.
        hold_segment: the step-hold flag's segment name ("" when steps are never skipped;
            `step_hold.py`).
    """

    config: EngineConfig
    rank: int
    local_rank: int
    distributed_init_method: str
    sched_ring: str
    out_ring: str
    parent_pid: int
    lifeline_fd: int
    null_model: bool = False
    hold_segment: str = ""


class RpcRequest(msgspec.Struct, array_like=True, gc=False):
    """A utility call on every worker: `getattr(worker, method)(*args)`.

    Attributes:
        call_id: matches the replies to the call.
        method: a public method name of `ringserve.gpu.worker.Worker`.
        args: positional arguments (msgpack values, numpy arrays, tensors).
    """

    call_id: int
    method: str
    args: tuple[Any, ...] = ()


class RpcReply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One rank's answer to an `RpcRequest`.

    Attributes:
        call_id: the request's id.
        rank: the answering rank.
        value: the method's return value (when `error` is None).
        error: "ExceptionType: message" when the method raised (or its value cannot be sent).
    """

    call_id: int
    rank: int
    value: Any = None
    error: str | None = None


class StepError(msgspec.Struct, array_like=True, gc=False):
    """A worker's `execute_model` raised: an engine fault.

    Attributes:
        step_id: the step that failed.
        rank: the rank that raised.
        error: "ExceptionType: message".
        traceback: the worker-side traceback, for the log.
    """

    step_id: int
    rank: int
    error: str
    traceback: str


def _align8(n: int) -> int:
    return (n + 7) & ~7


def write_message(ring: RingWriter, kind: FrameKind, bufs: Sequence[Buffer]) -> None:
    """Lay `bufs` (body first) out in one frame of `ring` and publish it.

    The buffers are copied straight into the reserved frame, so an array costs exactly one
    copy (device or pinned memory -> ring) and the body is never joined with them first.

    Raises:
        FrameTooLargeError: the message exceeds half the ring's capacity.
        PeerDiedError, RingClosedError: the reader went away while the ring was full.
    """
    views = [memoryview(b).cast("B") if not isinstance(b, bytes) else memoryview(b) for b in bufs]
    header = _COUNT.size + _LEN.size * len(views)
    total = header + sum(_align8(v.nbytes) for v in views)
    frame = ring.reserve(total)
    _COUNT.pack_into(frame, 0, len(views), 0)
    offset = header
    for i, view in enumerate(views):
        _LEN.pack_into(frame, _COUNT.size + _LEN.size * i, view.nbytes)
        frame[offset : offset + view.nbytes] = view
        offset += _align8(view.nbytes)
    ring.commit(int(kind), nbytes=total)


def read_buffers(data: memoryview, *, copy_out_of_band: bool) -> list[Buffer]:
    """Split a frame written by `write_message` back into its buffers.

    Args:
        data: the frame's payload (a view into the ring).
        copy_out_of_band: copy buffers 1.. into owned `bytearray`s, so arrays decoded from
            them outlive the frame's release; buffer 0 (the body) is always a view.

    Raises:
        ValueError: the frame is not laid out as `write_message` lays it out.
    """
    if data.nbytes < _COUNT.size:
        raise ValueError(f"executor frame of {data.nbytes} bytes has no buffer count")
    count, _ = _COUNT.unpack_from(data, 0)
    offset = _COUNT.size + _LEN.size * count
    if offset > data.nbytes:
        raise ValueError(f"executor frame claims {count} buffers in {data.nbytes} bytes")
    out: list[Buffer] = []
    for i in range(count):
        (length,) = _LEN.unpack_from(data, _COUNT.size + _LEN.size * i)
        if offset + length > data.nbytes:
            raise ValueError(f"executor frame buffer {i} overruns the frame")
        view = data[offset : offset + length]
        out.append(bytearray(view) if i and copy_out_of_band else view)
        offset += _align8(length)
    return out
