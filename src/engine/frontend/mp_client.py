"""Multiprocess engine-core clients: the core runs in its own process, reached over zmq.

`CoreProcess` launches `python -m ringserve.engine.core.core_main` (config as msgpack on stdin, a
lifeline pipe, the two zmq addresses) and watches it with a thread blocked in `Popen.wait`, so
its death is noticed at once. `SyncMPClient` (for `LLMEngine` and `LLM`) binds a ROUTER for
requests and a PULL for outputs on ipc:// paths in a private temporary directory, waits for the
core's handshake (raising `EngineStartupError` with the core's own reason), and then sends
`CoreInput`s and receives `EngineCoreOutputs` (zero-copy frames; a frame that does not decode
is logged and dropped). No pickle anywhere. A send never blocks forever on a core that died,
and an abort never blocks or is dropped: one that meets a full pipe (the core is stopped or
slow to read) is queued and goes out before the next message, and from `get_output` /
`call_utility` as soon as the pipe has room.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from ringserve import envs
from ringserve.config import EngineConfig
from ringserve.engine.errors import EngineDeadError, EngineStartupError
from ringserve.engine.frontend.core_client import EngineCoreClient
from ringserve.engine.frontend.ipc_dir import make_ipc_dir
from ringserve.engine.wire import (
    DEAD_CALL_ID,
    AbortRequests,
    AddRequest,
    EngineCoreOutputs,
    EngineCoreRequest,
    HandshakeReply,
    UtilityCall,
)
from ringserve.lifeline import STOP_SIGNAL, Lifeline, peek_exit_status
from ringserve.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

_POLL_MS = 100


class ChildProcess:
    """A child process of ours, holding a lifeline to this one, watched by its own thread.

    Args:
        cmd: the command line; `--lifeline-fd N --parent-pid P` are appended.
        stdin: bytes written to the child's stdin (then closed).
        name: for the watcher thread's name.
        pass_fds: more file descriptors the child inherits.
        new_group: start it in a process group of its own (a terminal's Ctrl-C then reaches
            only this process, which decides how its children stop).
    """

    def __init__(self, cmd: list[str], stdin: bytes, name: str,
                 pass_fds: tuple[int, ...] = (), new_group: bool = False) -> None:
        self._group = 0 if new_group else None
        self.lifeline = Lifeline.create()
        cmd = [*cmd, "--lifeline-fd", str(self.lifeline.child_fd),
               "--parent-pid", str(os.getpid())]
        self._pass_fds = (self.lifeline.child_fd, *pass_fds)
        self.exited = threading.Event()
        started: Future[subprocess.Popen[bytes]] = Future()
        # The child is forked by a thread that lives exactly as long as the child: Linux sends
        # PR_SET_PDEATHSIG when the *forking thread* exits, so forking from a short-lived
        # thread (trio's to_thread cache retires idle threads after ~10 s) would kill it.
        self._watcher = threading.Thread(
            target=self._spawn_and_watch, args=(cmd, stdin, started),
            daemon=True, name=f"ringserve-{name}-watch")
        self._watcher.start()
        self.proc = started.result()
        self.lifeline.child_started()

    def _spawn_and_watch(self, cmd: list[str], config: bytes,
                         started: Future[subprocess.Popen[bytes]]) -> None:
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=self._pass_fds,
                                    process_group=self._group)
        except BaseException as exc:
            started.set_exception(exc)
            self.exited.set()
            return
        started.set_result(proc)
        assert proc.stdin is not None  # stdin=PIPE
        try:
            proc.stdin.write(config)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once; wait() says how
        proc.wait()
        self.exited.set()

    @property
    def pid(self) -> int:
        """The child's pid."""
        return self.proc.pid

    def describe_exit(self) -> str:
        """How the process ended, for error messages (it may not be reaped yet)."""
        code = self.proc.returncode
        if code is None:
            exited, code = peek_exit_status(self.pid)
            if not exited:
                return "still running"
            if code is None:  # reaped this instant by the watcher thread, which stores it next
                self.exited.wait(1.0)
                code = self.proc.returncode
        if code is None:
            return "exited"
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def signal_stop(self) -> None:
        """Send the stop signal without waiting (stopping several cores at once: `terminate`
        then waits). `lifeline.STOP_SIGNAL`, not SIGTERM: the child ignores the SIGTERM that a
        stop of the whole process group sends it, so that it outlives its parent's drain."""
        if self.proc.poll() is None:
            self.proc.send_signal(STOP_SIGNAL)

    def terminate(self, timeout: float = 10.0) -> None:
        """The stop signal, wait up to `timeout`, then SIGKILL; cuts the lifeline; idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(STOP_SIGNAL)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.lifeline.cut()


class CoreProcess(ChildProcess):
    """One engine-core child process and its lifeline.

    Args:
        config: the engine configuration (sent on the child's stdin).
        engine_index: the data-parallel rank.
        input_addr: the ROUTER address the core connects its DEALER to (a list: one per
            frontend of a scaled-out deployment).
        output_addr: the PULL address the core connects its PUSH to (a list: the same
            frontends, in the same order).
        executor: "default", or "null" / "null-mp" (engine-overhead benchmark: a null model
            in the core process, or in mp worker processes behind the rings).
        topology: the scaled-out deployment's layout (`cluster_wire.ClusterTopology`).
        greet_not_before: the core sends its ready handshake no earlier than this
            `time.monotonic()` (the host's clock; None: as soon as it is ready).
    """

    # Set when the core is stopped on purpose (elastic scale-down): its exit is no fault.
    retiring = False

    def __init__(self, config: EngineConfig, engine_index: int, input_addr: str | list[str],
                 output_addr: str | list[str], executor: str = "default",
                 topology: Any = None, greet_not_before: float | None = None) -> None:
        self.engine_index = engine_index
        inputs = [input_addr] if isinstance(input_addr, str) else input_addr
        outputs = [output_addr] if isinstance(output_addr, str) else output_addr
        cmd = [sys.executable, "-m", "ringserve.engine.core.core_main",
               "--engine-index", str(engine_index), "--executor", executor]
        for addr in inputs:
            cmd += ["--input-addr", addr]
        for addr in outputs:
            cmd += ["--output-addr", addr]
        if topology is not None:
            cmd += ["--topology", msgspec.msgpack.encode(topology).hex()]
        if greet_not_before is not None:
            cmd += ["--greet-not-before", repr(greet_not_before)]
        super().__init__(cmd, msgspec.msgpack.encode(config), f"core{engine_index}")


def wait_for_handshakes(sock: zmq.Socket[Any], processes: list[CoreProcess],
                        timeout: float) -> list[HandshakeReply]:
    """Wait (blocking) until every core has sent its ready handshake on `sock`.

    Raises:
        EngineStartupError: a core reported why it failed, exited first, or `timeout` passed.
    """
    replies: list[HandshakeReply] = []
    deadline = time.monotonic() + timeout
    while len(replies) < len(processes):
        if sock.poll(_POLL_MS):
            reply = msgspec.msgpack.decode(sock.recv(), type=HandshakeReply)
            if not reply.ready:
                raise EngineStartupError(f"engine core failed to start: {reply.error}")
            replies.append(reply)
            continue
        for proc in processes:
            if proc.exited.is_set():
                raise EngineStartupError(
                    f"engine core {proc.engine_index} {proc.describe_exit()} before it was "
                    "ready (its stderr above says why)")
        if time.monotonic() >= deadline:
            raise EngineStartupError(f"engine cores did not become ready within {timeout:.0f} s "
                                     "(RINGSERVE_ENGINE_READY_TIMEOUT_S)")
    return replies


class SyncMPClient(EngineCoreClient):
    """A blocking client of one engine core in a child process.

    Args:
        config: the engine configuration.
        executor: "default", "null" or "null-mp" (see `CoreProcess`).

    Raises:
        EngineStartupError: the core failed to start (its reason) or did not answer in time.
    """

    def __init__(self, config: EngineConfig, executor: str = "default") -> None:
        self.ctx = zmq.Context(io_threads=1)
        self._dir = make_ipc_dir()
        self.input_sock = self.ctx.socket(zmq.ROUTER)
        self.input_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.input_sock.setsockopt(zmq.LINGER, 0)
        self.output_sock = self.ctx.socket(zmq.PULL)
        self.output_sock.setsockopt(zmq.LINGER, 0)
        input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self.input_sock.bind(input_addr)
        self.output_sock.bind(output_addr)
        self._identity = b"core0"
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self._pending: collections.deque[EngineCoreOutputs] = collections.deque()
        self._aborts: list[str] = []  # aborts that met a full pipe, oldest first
        self._call_ids = itertools.count(1)
        self._dead: str | None = None
        self._closed = False
        self.process = CoreProcess(config, 0, input_addr, output_addr, executor)
        try:
            (reply,) = wait_for_handshakes(self.output_sock, [self.process],
                                           envs.engine_ready_timeout_s())
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = reply.num_blocks
        self.max_model_len = reply.max_model_len


    # -- sending ---------------------------------------------------------------------------------

    def _send(self, message: Any) -> None:
        """Send after the queued aborts, waiting while the core's pipe is full."""
        while not (self._flush_aborts() and self._send_nowait(message)):
            while not self.input_sock.poll(_POLL_MS, zmq.POLLOUT):
                self._check_core()

    def _check_core(self) -> None:
        if self.process.exited.is_set():
            self._learn_why_dead()
        if self._dead is not None:  # nothing can be sent to a dead core, pending outputs or not
            raise EngineDeadError(self._dead)

    def _send_nowait(self, message: Any) -> bool:
        """One non-blocking send; False when the core's pipe is full."""
        self._check_core()
        try:
            self.input_sock.send_multipart([self._identity, *self._encoder.encode(message)],
                                           flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            self.process.exited.wait(1.0)
            self._learn_why_dead()
            self._mark_dead(f"cannot reach the engine core: {exc}")
            raise EngineDeadError(self._dead or str(exc)) from exc
        return True

    def _flush_aborts(self) -> bool:
        """Send the queued aborts; False when the pipe is still full."""
        if self._aborts and self._send_nowait(AbortRequests(self._aborts)):
            self._aborts = []
        return not self._aborts

    def _learn_why_dead(self) -> None:
        """The core exited: read what it sent last (its dead notice says why)."""
        while self._dead is None and self.output_sock.poll(0):
            outputs = self._recv(0)
            if outputs is not None and outputs.outputs:
                self._pending.append(outputs)
        self._mark_dead(f"engine core {self.process.describe_exit()}")

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(AddRequest(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort without blocking: what meets a full pipe is queued (see the module doc)."""
        if request_ids and self._dead is None:
            self._aborts.extend(request_ids)
            self._flush_aborts()

    # -- receiving -------------------------------------------------------------------------------

    def _poll_output(self, timeout_ms: int) -> bool:
        """Wait up to `timeout_ms` for an output; queued aborts go out meanwhile, as soon as
        the pipe has room (then this returns early)."""
        if not self._aborts or self._dead is not None or self.process.exited.is_set():
            return bool(self.output_sock.poll(timeout_ms))
        poller = zmq.Poller()
        poller.register(self.output_sock, zmq.POLLIN)
        poller.register(self.input_sock, zmq.POLLOUT)
        ready = dict(poller.poll(timeout_ms))
        if self.input_sock in ready:
            self._flush_aborts()
        return self.output_sock in ready

    def _recv(self, timeout_ms: int) -> EngineCoreOutputs | None:
        if not self._poll_output(timeout_ms):
            if self.process.exited.is_set() and not self.output_sock.poll(0):
                self._mark_dead(f"engine core {self.process.describe_exit()}")
            return None
        frames = self.output_sock.recv_multipart(copy=False)
        try:
            outputs = self._decoder.decode([f.buffer for f in frames])
        except (msgspec.MsgspecError, ValueError, TypeError) as exc:
            logger.warning("dropped a malformed engine-core output frame: %s", exc)
            return None
        utility = outputs.utility_output
        if utility is not None and utility.call_id == DEAD_CALL_ID:
            self._mark_dead(f"engine core failed: {utility.failure_message}")
            self._pending.append(EngineCoreOutputs(engine_index=outputs.engine_index))
        return outputs

    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs; blocks until one arrives.

        Raises:
            EngineDeadError: the core died (after its final outputs were delivered).
        """
        while True:
            if self._pending:
                return self._pending.popleft()
            self._check_alive()
            outputs = self._recv(_POLL_MS)
            if outputs is not None and outputs.utility_output is None:
                return outputs
            if outputs is not None and outputs.outputs:
                return outputs

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        self._send(UtilityCall(call_id, method, list(args)))
        while True:
            self._check_alive()
            outputs = self._recv(_POLL_MS)
            if outputs is None:
                continue
            utility = outputs.utility_output
            if utility is not None and utility.call_id == call_id:
                if utility.failure_message is not None:
                    raise ValueError(utility.failure_message)
                return utility.result
            if outputs.outputs or outputs.finished_requests:
                self._pending.append(outputs)

    def _mark_dead(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason

    def _check_alive(self) -> None:
        if self._dead is not None and not self._pending:
            raise EngineDeadError(self._dead)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._mark_dead("the engine was shut down")
        self.process.terminate()
        self.input_sock.close(linger=0)
        self.output_sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
