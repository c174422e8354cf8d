"""The worker process of the multiprocess executor: `python -m ringserve.gpu.executor.worker_proc`.

Started by `multiproc.MultiprocExecutor` (never by hand). Start-up, in this order so a broken
start is reported quickly: tie itself to the parent (`install_lifeline`: title
`ringserve::Worker_TP<rank>`, PR_SET_PDEATHSIG, lifeline pipe), read its `WorkerSpec` (msgpack)
from stdin, attach the step-hold flag (when the spec names one), the broadcast ring as reader
`rank` and its own response ring as writer (before torch is imported, so the executor's attach
wait is short), build the `Worker`, then
serve the broadcast ring until a shutdown frame or the executor's death:

* `STEP`: run `Worker.execute_model`; rank 0 sends the `ModelRunnerOutput` back (body and
  array buffers laid into one frame); an exception becomes a `StepError` frame from the rank
  that raised, and the loop goes on (the executor treats it as an engine fault);
* `RPC`: call the named public method of the `Worker`; every rank replies (value or error);
* a `STEP` read while the core's step-hold flag is up (a pause came: `step_hold.py`) is not
  run: `Worker.skip_step` applies its bookkeeping and the reply is marked `skipped` (a
  captured decode step running when the flag goes up ends between two layers and is answered
  the same way); the grammar bitmask that may follow such a step answers nothing;
* `SHUTDOWN`: close both rings and exit 0.

Signals: SIGTERM and SIGINT are ignored (`lifeline.ignore_group_signals`: a stop of the whole
process group must not end a worker under the server's drain); the executor's stop signal
(`lifeline.STOP_SIGNAL`, its fallback after the shutdown frame) ends the process at once.

Every frame is decoded and released before the work starts, so the executor can queue the
next step while this one runs (async scheduling). A frame that does not decode as the type its
kind names (or an unknown kind, or an invalid ring header) is logged to stderr (rate-limited)
and dropped, and the worker keeps serving; it sends nothing back for it, so the executor sees a
lost answer (`inbound.py` says how that surfaces: the next step's output, or the engine core's
execute-model timeout).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import msgspec

from ringserve.gpu.executor.inbound import DECODE_ERRORS, DropLog, RequestDecoder, kind_name
from ringserve.gpu.executor.step_hold import HoldFlag
from ringserve.gpu.executor.wire import (
    FrameKind,
    WorkerSpec,
    read_buffers,
    write_message,
)
from ringserve.gpu.executor.worker_calls import reply_to, step_reply
from ringserve.gpu.wire import SchedulerOutput
from ringserve.lifeline import ignore_group_signals, install_lifeline
from ringserve.serial import MsgpackEncoder
from ringserve.shm import CorruptFrameError, PeerDiedError, RingClosedError, RingReader, RingWriter


class WorkerLoop:
    """Serves one worker's rings (everything after start-up).

    Args:
        worker: the `ringserve.gpu.worker.Worker` (typed loosely: built after torch's import).
        rank: the TP rank.
        sched: the broadcast ring's reading end.
        out: this rank's response ring's writing end.
        hold: the step-hold flag (None where steps are never skipped: `step_hold.py`).
    """

    def __init__(self, worker: Any, rank: int, sched: RingReader, out: RingWriter,
                 hold: HoldFlag | None = None) -> None:
        self.worker = worker
        self.hold = hold
        self.rank = rank
        self.sched = sched
        self.out = out
        self._decoder = RequestDecoder()
        self._encoder = MsgpackEncoder()
        self.drops = DropLog(f"worker rank {rank}")

    def run(self) -> None:
        """Serve frames until a shutdown frame (returns) or the executor's death (raises).

        A malformed frame (or an invalid ring header) is logged and dropped: nothing is sent
        back for it, and the loop goes on with the next frame.

        Raises:
            PeerDiedError, RingClosedError: the executor died or closed the ring.
            CorruptRingError: the broadcast ring's control block is corrupt.
        """
        sched = self.sched
        while True:
            try:
                frame = sched.recv()
            except CorruptFrameError as exc:
                sched.release()  # hand the skipped bytes back, or the writer may wait for them
                self.drops.drop(exc)
                continue
            kind = frame.kind
            if kind == FrameKind.SHUTDOWN:
                sched.release()
                return
            try:
                message = self._decoder.decode(kind, read_buffers(frame.data, copy_out_of_band=True))
            except DECODE_ERRORS as exc:
                self.drops.drop(f"{kind_name(kind)} frame: {exc}")
                continue
            finally:
                # Released before the work starts, so the executor can queue the next step.
                sched.release()
            hold = self.hold
            if hold is not None and hold.is_up() and isinstance(message, SchedulerOutput):
                reply = step_reply(self.worker, self.rank, message, self._encoder, skip=True)
            else:
                reply = reply_to(self.worker, self.rank, message, self._encoder)
            if reply is not None:
                write_message(self.out, *reply)


def _limit_cpu_threads(spec: WorkerSpec) -> None:
    """On CPU, share the cores between the TP ranks unless OMP_NUM_THREADS says otherwise."""
    import torch

    tp = spec.config.parallel_config.tensor_parallel_size
    if spec.config.device_config.device == "cpu" and tp > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))


def serve(spec: WorkerSpec) -> None:
    """Attach the rings, build the worker and serve until shutdown (the process's body)."""
    # Before the rings: the executor unlinks the flag's name once they are attached.
    hold = HoldFlag(spec.hold_segment) if spec.hold_segment and not spec.null_model else None
    sched = RingReader.attach(spec.sched_ring, spec.rank)
    out = RingWriter.attach(spec.out_ring)
    try:
        _limit_cpu_threads(spec)
        worker: Any
        if spec.null_model:
            from ringserve.gpu.executor.null import NullWorker

            worker = NullWorker(spec.config)
        else:
            from ringserve.gpu.worker import Worker

            worker = Worker(
                spec.config, rank=spec.rank, local_rank=spec.local_rank,
                distributed_init_method=spec.distributed_init_method,
            )
        if hold is not None:
            worker.set_abort_flag(hold.address)  # the captured decode step reads it
        WorkerLoop(worker, spec.rank, sched, out, hold).run()
    finally:
        out.close()
        sched.close()
        if hold is not None:
            hold.close()


def main() -> int:
    """Entry point: read the spec from stdin and serve; the exit status is the outcome."""
    raw = sys.stdin.buffer.read()
    spec = msgspec.msgpack.decode(raw, type=WorkerSpec)
    install_lifeline(spec.lifeline_fd, spec.parent_pid, f"ringserve::Worker_TP{spec.rank}")
    # A terminal's Ctrl-C, systemd and `kill 0` signal the whole process group (or cgroup);
    # the executor stops its workers (the shutdown frame, then STOP_SIGNAL's default action).
    ignore_group_signals()
    try:
        serve(spec)
    except (PeerDiedError, RingClosedError):
        return 1  # the executor is gone or closed its end: nobody to report to
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except BaseException:  # reported here; the exit status says it
        traceback.print_exc()
        status = 1
    # The rings are closed and nothing else needs finalising: skip torch's slow teardown
    # (hundreds of milliseconds, more with a process group, and gloo's threads can abort it:
    # "terminate called without an active exception") so shutdown() is quick and the exit
    # status is the outcome.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
