"""What a worker does with a step or an RPC, whatever transport brought it.

Shared by the mp executor's worker processes (`worker_proc.py`, shm rings) and the Ray actors
(`ray_worker.py`, zmq over TCP): both decode a frame, call one of these, and send the frame
kind and buffers it returns through their own transport.
"""

from __future__ import annotations

import traceback
from typing import Any

from ringserve.gpu.executor.wire import FrameKind, RpcReply, RpcRequest, StepError
from ringserve.gpu.wire import GrammarOutput
from ringserve.serial import Buffer, MsgpackEncoder


def describe(exc: BaseException) -> str:
    """`Type: message`, as error frames carry it."""
    return f"{type(exc).__name__}: {exc}"


def step_reply(worker: Any, rank: int, message: Any, encoder: MsgpackEncoder,
               skip: bool = False) -> tuple[FrameKind, list[Buffer]] | None:
    """Run one step (a SchedulerOutput), or sample one that waited for its grammar (a
    GrammarOutput); the frame to send back (rank 0's output, or any rank's error), if any.
    A step with constrained rows answers nothing until its grammar has come. `skip`: apply
    the step's bookkeeping only (`Worker.skip_step`; a pause came, `step_hold.py`)."""
    try:
        if skip:
            output = worker.skip_step(message)
        elif isinstance(message, GrammarOutput):
            output = worker.sample_tokens(message)
        else:
            output = worker.execute_model(message)
    except Exception as exc:
        error = StepError(message.step_id, rank, describe(exc), traceback.format_exc())
        return FrameKind.STEP_ERROR, encoder.encode(error)
    if rank == 0 and output is not None:
        return FrameKind.OUTPUT, encoder.encode(output)
    return None


def rpc_reply(worker: Any, rank: int, request: RpcRequest, encoder: MsgpackEncoder) -> list[Buffer]:
    """Call a public worker method; the encoded reply (its value, or why it failed)."""
    reply = RpcReply(request.call_id, rank)
    try:
        if request.method.startswith("_"):
            raise AttributeError(f"{request.method!r} is private; only public methods")
        reply.value = getattr(worker, request.method)(*request.args)
        return encoder.encode(reply)
    except Exception as exc:
        reply.value = None
        reply.error = describe(exc)
        return encoder.encode(reply)


def reply_to(worker: Any, rank: int, message: Any,
             encoder: MsgpackEncoder) -> tuple[FrameKind, list[Buffer]] | None:
    """Serve one decoded request (an `RpcRequest`, else a SchedulerOutput or GrammarOutput);
    the frame to send back, if any."""
    if isinstance(message, RpcRequest):
        return FrameKind.RPC_REPLY, rpc_reply(worker, rank, message, encoder)
    return step_reply(worker, rank, message, encoder)
