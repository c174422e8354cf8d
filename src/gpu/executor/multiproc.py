"""The multiprocess executor: one worker process per TP rank, driven over shared-memory rings.

Processes: `MultiprocExecutor` starts `tensor_parallel_size` processes of
`python -m ringserve.gpu.executor.worker_proc` (plain `subprocess.Popen`, never
`multiprocessing`: no pickle anywhere). Each gets its `WorkerSpec` (the EngineConfig and ring
names, msgpack) on stdin and a lifeline pipe (`pass_fds`), and titles itself
`ringserve::Worker_TP<rank>`. TP > 1 joins torch.distributed (gloo on CPU, NCCL on CUDA) at a
free local port.

Rings (layout and frame kinds in `wire.py`): one broadcast ring carries every step
(`SchedulerOutput`), utility call (`RpcRequest`) and the shutdown frame to all ranks in one
order; each rank answers on its own SPSC response ring. Rank 0 alone returns step outputs;
every rank answers every utility call on its own ring (no gather through torch.distributed, so
a call works even when the TP group is wedged), and whichever rank raises in a step reports it.
One reader thread per response ring completes the futures in `Pending`: steps in submission
order, calls once every rank replied.

Death: each worker has a thread that starts it and then blocks in `Popen.wait()` (it is also
the thread that forked it, which matters because PR_SET_PDEATHSIG fires when the *forking
thread* ends: this thread lives exactly as long as its worker). A worker's exit outside
`shutdown()` fails every pending step and call at once with `WorkerDiedError` naming the rank
and exit status, and `check_health()` raises from then on; a reader parked on a dead worker's
ring wakes through the ring's pidfd watch as well.

Malformed frames (`inbound.py` says what each loss means to the protocol): a frame that does
not decode as the type its kind names, or whose ring header is invalid, is logged (rate-limited)
and dropped, and the reader thread keeps serving; the workers do the same on the broadcast
ring. A dropped frame is not a fault by itself. If it was a step's output, that step fails with
`FrameLostError` as soon as rank 0 answers a later step; if no later step comes, only the engine
core's `--execute-model-timeout-s` turns the wait into a fault (without it, the core waits for
good). A utility call whose reply was dropped fails once that rank answers a later call, else
when its `collective_rpc` timeout passes. A corrupt ring control block (`CorruptRingError`)
fails everything in flight, like a worker's death.

Zero copy: a worker lays the msgpack body and the array buffers straight into its ring frame;
the reader thread decodes the body in place. Array buffers (logprobs) are copied out of the
frame before it is released, because a ring releases all received frames at once and the
engine core may hold two outputs (async scheduling) for as long as it likes.

Waiting: the reader threads park on the ring's eventfd and never spin, since a thread spinning
in Python holds the GIL against the engine core's busy loop (measured on a 2-core box: an empty
step's round trip is ~130 us parked, ~300 us with the default spin window).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ringserve import envs
from ringserve.config import EngineConfig
from ringserve.gpu.executor.errors import ExecutorShutdownError, WorkerDiedError, WorkerError
from ringserve.gpu.executor.inbound import DECODE_ERRORS, ResponseHandler, kind_name
from ringserve.gpu.executor.remote import RemoteWorkersExecutor
from ringserve.gpu.executor.step_hold import StepHold
from ringserve.gpu.executor.wire import (
    FrameKind,
    StepError,
    WorkerSpec,
    read_buffers,
    write_message,
)
from ringserve.lifeline import STOP_SIGNAL, Lifeline, peek_exit_status
from ringserve.shm import (
    CorruptFrameError,
    PeerDiedError,
    RingClosedError,
    RingReader,
    RingTimeoutError,
    RingWriter,
    WaitPolicy,
)

logger = logging.getLogger(__name__)

# How long a failed step waits for a peer's death to show before reporting the step's error.
_PEER_DEATH_WAIT_S = 0.5

WORKER_MODULE = "ringserve.gpu.executor.worker_proc"
ATTACH_TIMEOUT_S = 30.0  # workers attach before importing torch; this only bounds a broken start
SHUTDOWN_GRACE_S = 2.0  # after the shutdown frame, before the stop signal
READ_TICK_S = 0.5  # a reader thread re-checks the stop flag this often (a fallback only)


def serve_responses(ring: RingReader, handler: ResponseHandler, stopping: Callable[[], bool],
                    tick_s: float = READ_TICK_S) -> None:
    """Decode every frame of one response ring into `handler`; drop the malformed ones.

    Returns when `stopping()` is true at a read tick (an idle ring is re-checked every
    `tick_s`). A frame is released before its message is applied: the decoded message owns its
    data (out-of-band arrays are copied out of the frame).

    Raises:
        PeerDiedError, RingClosedError: the worker died or closed the ring.
        CorruptRingError: the ring's control block is corrupt (nothing more can be read).
    """
    while True:
        try:
            frame = ring.recv(tick_s)
        except RingTimeoutError:
            if stopping():
                return
            continue
        except CorruptFrameError as exc:
            ring.release()  # hand the skipped bytes back, or the writer may wait for them
            handler.drops.drop(exc)
            continue
        try:
            message = handler.decode(frame.kind, read_buffers(frame.data, copy_out_of_band=True))
        except DECODE_ERRORS as exc:
            handler.drops.drop(f"{kind_name(frame.kind)} frame: {exc}")
            continue
        finally:
            ring.release()
        handler.apply(message)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for torch.distributed's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MultiprocExecutor(RemoteWorkersExecutor):
    """Runs one worker process per TP rank (see the module docstring).

    The constructor returns once every worker has joined the TP group and loaded the model.

    Args:
        config: the engine configuration (`tensor_parallel_size` workers are started).

    Raises:
        WorkerDiedError: a worker died during start-up.
        WorkerError: a worker raised during start-up (the message is the worker's).
        RingTimeoutError: a worker did not attach to the rings in time.
    """

    null_model = False  # NullMultiprocExecutor serves NullWorkers

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._stopping = False
        self._closed = False
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * self.world_size
        self._lifelines: list[Lifeline] = []
        self._threads: list[threading.Thread] = []
        self._readers: list[threading.Thread] = []
        capacity = envs.executor_ring_bytes()
        # Lets a pause skip the steps already queued (`step_hold.py`); None where it cannot.
        self._hold = StepHold.for_config(config)
        self._sched = RingWriter.create(capacity, self.world_size, label="sched")
        self._outs: list[RingReader] = []
        try:
            # Park, never spin: a spinning reader thread would hold the GIL against the core.
            park = WaitPolicy.forced_park()
            self._outs = [
                RingReader.create(capacity, 1, label=f"out{r}", policy=park)
                for r in range(self.world_size)
            ]
            self._start_workers()
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' pids, in rank order."""
        return [p.pid for p in self._procs if p is not None]

    # ---- start-up -------------------------------------------------------------------------

    def _start_workers(self) -> None:
        init_method = f"tcp://127.0.0.1:{free_port()}" if self.world_size > 1 else ""
        started: list[Future[subprocess.Popen[bytes]]] = []
        for rank in range(self.world_size):
            lifeline = Lifeline.create()
            self._lifelines.append(lifeline)
            spec = WorkerSpec(
                self.config, rank, rank, init_method, self._sched.name, self._outs[rank].name,
                os.getpid(), lifeline.child_fd, self.null_model,
                "" if self._hold is None else self._hold.name,
            )
            future: Future[subprocess.Popen[bytes]] = Future()
            thread = threading.Thread(
                target=self._run_worker, args=(rank, spec, lifeline, future),
                name=f"ringserve-worker{rank}-wait", daemon=True,
            )
            thread.start()
            self._threads.append(thread)
            started.append(future)
        for rank, future in enumerate(started):
            self._procs[rank] = future.result()
        self._attach_rings()
        if self._hold is not None:
            self._hold.unlink()  # every worker mapped it before attaching its rings
        for rank in range(self.world_size):
            reader = threading.Thread(
                target=self._read_loop, args=(rank,), name=f"ringserve-worker{rank}-out", daemon=True
            )
            reader.start()
            self._readers.append(reader)

    def _attach_rings(self) -> None:
        try:
            self._sched.wait_attached(ATTACH_TIMEOUT_S)
            for out in self._outs:
                out.wait_attached(ATTACH_TIMEOUT_S)
        except RingTimeoutError as exc:
            dead = [(r, p.poll()) for r, p in enumerate(self._procs) if p and p.poll() is not None]
            if dead:
                raise WorkerDiedError(*dead[0]) from exc
            raise

    def _run_worker(
        self, rank: int, spec: WorkerSpec, lifeline: Lifeline, started: Future[subprocess.Popen[bytes]]
    ) -> None:
        """Start worker `rank`, then wait for its exit (this thread is its forking thread)."""
        import msgspec

        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE,
                pass_fds=(lifeline.child_fd,), close_fds=True,
            )
        except BaseException as exc:
            started.set_exception(exc)
            return
        lifeline.child_started()
        started.set_result(proc)
        assert proc.stdin is not None  # stdin=PIPE
        try:
            proc.stdin.write(msgspec.msgpack.encode(spec))
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once; wait() below reports how
        exitcode = proc.wait()
        if not self._stopping:
            error = WorkerDiedError(rank, exitcode)
            self._pending.fail(error)
            self._notify_failure(error)

    # ---- responses ------------------------------------------------------------------------

    def _read_loop(self, rank: int) -> None:
        """Serve rank `rank`'s response ring until the worker closes it, dies, or we stop."""
        handler = ResponseHandler(self._pending, self._step_failed, f"worker rank {rank}")
        try:
            serve_responses(self._outs[rank], handler, lambda: self._stopping)
        except (PeerDiedError, RingClosedError):
            if not self._stopping:
                self._pending.fail(self._death_error(rank))
        except Exception as exc:  # a corrupt ring, or a bug here: a fault, never a silent hang
            if not self._stopping:
                logger.exception("worker rank %d: the response reader failed", rank)
                self._pending.fail(exc)

    def _step_failed(self, error: StepError) -> None:
        logger.error("worker rank %d failed in step %d:\n%s", error.rank, error.step_id, error.traceback)
        # A collective failing in one rank is most often the symptom of another rank's death
        # (gloo: "connection closed by peer"): report the death, the cause, when there is one.
        died = self._dead_peer(error.rank)
        if died is not None:
            self._pending.fail(died)
            return
        message = f"worker rank {error.rank} failed in step {error.step_id}: {error.error}"
        self._pending.fail(WorkerError(error.rank, message, error.traceback))

    def _dead_peer(self, rank: int) -> WorkerDiedError | None:
        """A worker other than `rank` that has exited, waiting up to `_PEER_DEATH_WAIT_S` for
        one to show (a killed peer's sockets close as it dies); None when all are alive."""
        deadline = time.monotonic() + _PEER_DEATH_WAIT_S
        while True:
            for other, proc in enumerate(self._procs):
                if other == rank or proc is None:
                    continue
                exited, exitcode = _exit_status(proc)
                if exited:
                    return WorkerDiedError(other, exitcode)
            if time.monotonic() >= deadline or self.world_size == 1:
                return None
            time.sleep(0.01)

    def _death_error(self, rank: int) -> WorkerDiedError:
        """The error for a worker whose ring says it is gone (its exit status, if it has one)."""
        proc = self._procs[rank]
        exitcode: int | None = None
        if proc is not None:
            try:
                exitcode = proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                exitcode = None  # it closed its ring but lingers; the wait thread reports later
        return WorkerDiedError(rank, exitcode)

    # ---- the Executor interface -----------------------------------------------------------

    def hold_steps(self, up: bool) -> bool:
        """Raise or lower the step-hold flag (`step_hold.py`); False where steps are never
        skipped."""
        if self._hold is None or self._closed:
            return False
        self._hold.set(up)
        return True

    def _send(self, kind: FrameKind, message: Any) -> None:
        write_message(self._sched, kind, self._encoder.encode(message))

    def _poll_deaths(self) -> None:
        for rank, proc in enumerate(self._procs):
            if proc is not None and proc.poll() is not None and not self._stopping:
                self._pending.fail(WorkerDiedError(rank, proc.returncode))

    # ---- shutdown -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the workers, join, close; idempotent.

        Idle workers get a shutdown frame, then the stop signal (`lifeline.STOP_SIGNAL`: they
        ignore SIGTERM, which a stop of the whole process group sends them), then SIGKILL.
        After a fault, or with a step or call still unanswered (a hung or dead worker), they
        are killed at once: nothing in them is worth waiting for, and a stopped process
        ignores the frame and the stop signal.
        """
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        if self._pending.idle():
            self._send_shutdown_frame()
            self._reap_workers()
        else:
            self._kill_workers()
        for lifeline in self._lifelines:
            lifeline.child_started()
            lifeline.cut()
        for thread in [*self._readers, *self._threads]:
            thread.join(timeout=2.0)
        self._pending.fail(ExecutorShutdownError("the executor was shut down"))
        if self._hold is not None:
            self._hold.close()  # only the core's busy loop and input thread write it
        if any(thread.is_alive() for thread in self._readers):
            # Unmapping under a thread still inside recv() would crash it; leave the mappings.
            logger.warning("executor reader threads did not stop; leaving their rings mapped")
            return
        for ring in [self._sched, *self._outs]:
            ring.close()

    def _send_shutdown_frame(self) -> None:
        if not self._send_lock.acquire(timeout=1.0):
            return  # a sender is stuck on a full ring (a hung worker): the signals below do it
        try:
            self._sched.send(b"", int(FrameKind.SHUTDOWN), timeout=1.0)
        except Exception:
            pass  # workers already gone, or not attached: the signals below do it
        finally:
            self._send_lock.release()

    def _kill_workers(self) -> None:
        procs = [p for p in self._procs if p is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()

    def _reap_workers(self) -> None:
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        procs = [p for p in self._procs if p is not None]
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.send_signal(STOP_SIGNAL)
        for proc in procs:
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _exit_status(proc: subprocess.Popen[bytes]) -> tuple[bool, int | None]:
    """(exited, exit status if known) without reaping: the worker's wait thread does that."""
    if proc.returncode is not None:
        return True, proc.returncode
    exited, status = peek_exit_status(proc.pid)
    return exited, proc.returncode if status is None else status
