"""EngineCoreProc: an engine core in its own process, with socket threads and a busy loop.

Started by a multiprocess client (`mp_client.py`) as `python -m ringserve.engine.core.core_main`;
the EngineConfig arrives as msgpack on stdin (`core_main` is the entry point: flags, signals,
the executor choice). The process names itself `ringserve::EngineCore_DP<i>`, holds a lifeline
to its parent, and talks over zmq:

* input: a DEALER socket (routing id `core<i>`) connected to the frontend's ROUTER; a thread
  decodes each `CoreInput` (add / abort / utility) into the input queue, and logs and drops a
  frame that does not decode as one (the core keeps serving);
* output: a PUSH socket connected to the frontend's PULL; a thread encodes whatever the busy
  loop puts in the output queue (msgpack body + out-of-band array frames, zero-copy).

The first output message is the start-up handshake (`HandshakeReply`): ready with the number of
KV blocks and max_model_len, or failed with the reason. Then `run_busy_loop` alternates draining
the input queue (blocking only when there is no work) and stepping the core, handing outputs to
the output thread without waiting. An exception in a step is an engine fault, handled by the
fault sentinel (`sentinel.py`, which runs the busy loop): with fault tolerance on the core
reports UNHEALTHY and waits for a retry/abort instruction; with it off, or when no instruction
comes in time, every in-flight request ends with finish reason error, a dead notice (utility
call id -1) is sent, and the process exits with status 1. The parent's stop signal (`lifeline.STOP_SIGNAL`) ends the
loop and exits 0; SIGTERM and SIGINT are ignored (a terminal's Ctrl-C, systemd and `kill 0`
reach the whole process group, and the parent stops the core itself, after its drain).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from ringserve.config import EngineConfig
from ringserve.engine.cluster.wire import ClusterTopology
from ringserve.engine.core.core_links import BROADCAST, ClientLinks
from ringserve.engine.core.dp_wave import PeerFault, WaveSync
from ringserve.engine.core.engine_core import EngineCore
from ringserve.engine.core.faults import DeclaredHung, FaultInstruction, describe, heartbeat_s
from ringserve.engine.core.lockstep_proc import LockstepProcMixin, PeerFaulted, WaveStarted
from ringserve.engine.wire import (
    CORE_HUNG_METHOD,
    DEAD_CALL_ID,
    FAULT_INSTRUCTION_METHOD,
    AbortRequests,
    AddRequest,
    CoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    HandshakeReply,
    UtilityCall,
    UtilityOutput,
)
from ringserve.gpu.executor.base import Executor
from ringserve.gpu.executor.errors import ExecutorError
from ringserve.lifeline import STOP_SIGNAL

logger = logging.getLogger(__name__)


class _ExecutorFailed:
    """Put in the input queue by the executor's failure callback: wakes an idle busy loop.

    `executor` is the one that failed: after a retry, a notice from the replaced executor is
    stale and ignored.
    """

    def __init__(self, error: BaseException, executor: Executor) -> None:
        self.error = error
        self.executor = executor


class _Wake:
    """Put in the input queue when a grammar has compiled: wakes an idle busy loop."""


_WAKE = _Wake()


class _ClientGone:
    """Put in the input queue by the input thread: frontend `client`'s link dropped (it
    died); its requests are aborted."""

    def __init__(self, client: int) -> None:
        self.client = client


class OutputThreadDied(BaseException):
    """Raised in the main thread (SIGUSR1) when the output thread has died: the core can no
    longer answer, so the process exits 1 (not an Exception: no fault handler catches it)."""


class _OutputDied:
    """The input-queue marker of the output thread's death (see `_interrupt_main`)."""


_OUTPUT_DIED = _OutputDied()
_output_died_raised = threading.Event()


def _interrupt_main() -> None:
    # To the main thread itself: a process-directed signal may land on another thread, and
    # the main thread, blocked waiting for input, would then never run the handler.
    main = threading.main_thread().ident
    assert main is not None
    signal.pthread_kill(main, signal.SIGUSR1)


def _raise_output_died_once() -> None:
    # The signal and the input-queue marker may both arrive: the second is a no-op.
    if _output_died_raised.is_set():
        return
    _output_died_raised.set()
    raise OutputThreadDied("the engine core's output thread died")


def raise_output_died(signum: int, frame: Any) -> None:
    """The SIGUSR1 handler the process installs (`core_main`): the output thread died."""
    _raise_output_died_once()


def undecodable_request(body: Any, error: Exception) -> EngineCoreOutput | None:
    """The ERROR output for an input frame that did not decode but names a request.

    An `AddRequest` travels as `["add", [request_id, ...]]`; when the frame is still msgpack
    of that shape with a str id, the request is answered with finish reason ERROR (its
    sender would otherwise wait forever).

    Returns:
        The output, or None when the frame names no request.
    """
    try:
        raw = msgspec.msgpack.decode(body)
    except (msgspec.MsgspecError, ValueError, TypeError, RecursionError):
        return None
    if not (isinstance(raw, list) and len(raw) == 2 and raw[0] == "add"
            and isinstance(raw[1], list) and raw[1] and isinstance(raw[1][0], str)):
        return None
    return EngineCoreOutput(raw[1][0], [], finish_reason=FinishReason.ERROR,
                            stop_reason=f"the engine core could not decode the request: {error}")


class EngineCoreProc(LockstepProcMixin):
    """Runs one EngineCore behind zmq sockets.

    Args:
        config: the engine configuration.
        engine_index: the data-parallel rank (routing id and title).
        input_addr: the frontend's ROUTER address.
        output_addr: the frontend's PULL address.
        executor_class: override the executor (the null-model benchmark).
        on_output_failure: called from the output thread when it dies (default: interrupt
            the main thread with SIGUSR1, which raises `OutputThreadDied` there).
    """

    def __init__(self, config: EngineConfig, engine_index: int, input_addr: str | list[str],
                 output_addr: str | list[str], executor_class: type[Executor] | None = None,
                 on_output_failure: Callable[[], None] | None = None, *,
                 topology: ClusterTopology | None = None,
                 secure: Callable[[zmq.Socket[Any]], None] | None = None,
                 greet_not_before: float | None = None) -> None:
        if config.parallel_config.lockstep:  # the workers' EP ranks follow from it
            config = dataclasses.replace(config, parallel_config=dataclasses.replace(
                config.parallel_config, data_parallel_rank=engine_index))
        self.config = config
        self.engine_index = engine_index
        self.greet_not_before = greet_not_before
        self.ctx = zmq.Context(io_threads=1)
        inputs = [input_addr] if isinstance(input_addr, str) else list(input_addr)
        outputs = [output_addr] if isinstance(output_addr, str) else list(output_addr)
        if len(inputs) != len(outputs):
            raise ValueError("one output address per input address (one pair per frontend)")
        remote = topology is not None and engine_index in topology.remote_engines
        self.links = ClientLinks(
            self.ctx, engine_index, list(zip(inputs, outputs, strict=True)),
            watch=topology is not None,
            # A local core beats when its frontends watch it for hangs (`faults.py`).
            heartbeat_s=topology.heartbeat_s if topology is not None and remote
            else heartbeat_s(config),
            coordinator_addr=(topology.coordinator_input or None) if topology else None,
            secure=secure)
        self.input_queue: queue.Queue[
            CoreInput | _ExecutorFailed | _Wake | WaveStarted | PeerFaulted | _ClientGone
            | _OutputDied,
        ] = queue.Queue()
        self.waves: WaveSync | None = None
        self._at_wave_end: list[UtilityCall] = []
        # Unbounded on purpose: the busy loop must never block on output; the output thread
        # sends as fast as the socket allows and zmq's own high-water mark applies behind it.
        # Items are (client index or core_links.BROADCAST, message), or None to stop.
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._input_thread, daemon=True,
                             name="ringserve-core-input"),
            threading.Thread(target=self._output_thread, daemon=True,
                             name="ringserve-core-output"),
        ]
        for thread in self._threads:
            thread.start()
        self.core: EngineCore | None = None
        self.start_error = ""  # why start_core() failed
        self._executor_class = executor_class
        # Set (with the main thread interrupted) when the output thread dies.
        self.output_error: BaseException | None = None
        self._on_output_failure = on_output_failure or self._interrupt_main

    def send(self, client: int, message: Any) -> None:
        """Queue `message` for frontend `client` (the output thread sends it)."""
        self.output_queue.put((client, message))

    def broadcast(self, message: Any) -> None:
        """Queue `message` for every frontend (handshakes, fault status, the dead notice)."""
        self.output_queue.put((BROADCAST, message))

    def send_outputs(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """Queue a step's outputs, each batch for the frontend whose requests it holds."""
        put = self.output_queue.put
        for client, client_outputs in outputs.items():
            put((client, client_outputs))

    # -- socket threads ------------------------------------------------------------------------

    def _input_thread(self) -> None:
        put = self.input_queue.put

        def on_message(client: int, message: CoreInput) -> None:
            if isinstance(message, AddRequest):
                if message.request.client_index != client:
                    message = AddRequest(msgspec.structs.replace(message.request,
                                                                 client_index=client))
            elif isinstance(message, UtilityCall):
                if message.client_index != client:
                    message = msgspec.structs.replace(message, client_index=client)
                if _holds_steps(message) and self.core is not None:
                    # Before it is queued: the steps the workers have not started are
                    # skipped rather than waited for (ringserve.gpu.executor.step_hold).
                    self.core.hold_for_pause()
            put(message)

        def on_client(client: int, connected: bool) -> None:
            if not connected:
                put(_ClientGone(client))

        self.links.serve_inputs(on_message, self._malformed, on_client, self.output_queue)

    def _malformed(self, client: int, frames: list[Any], exc: Exception) -> None:
        # A frame that is not a CoreInput is the sender's bug, not a core fault.
        # One that names a request ends that request: its sender waits for it.
        failed = undecodable_request(frames[0].buffer if frames else b"", exc)
        logger.warning("engine core %d: dropped a malformed input frame%s: %s",
                       self.engine_index,
                       f" (request {failed.request_id!r} failed)" if failed else "", exc)
        if failed is not None:
            self.send(client, EngineCoreOutputs(engine_index=self.engine_index,
                                                outputs=[failed],
                                                finished_requests=[failed.request_id]))

    def _interrupt_main(self) -> None:
        # The signal interrupts a main thread inside a step. One that is about to block on the
        # input queue can miss it (the handler only runs once the thread is back in Python:
        # a signal landing just before the wait leaves it asleep), so the queue wakes it too.
        self.input_queue.put(_OUTPUT_DIED)
        _interrupt_main()

    def _output_thread(self) -> None:
        def on_sent(seconds: float) -> None:
            if self.core is not None:
                timings = self.core.timings
                timings["output"] = timings.get("output", 0.0) + seconds

        try:
            self.links.serve_outputs(self.output_queue, on_sent)
        except BaseException as exc:
            # Without this thread the core would live on and never answer again: an engine
            # fault. The main thread is interrupted and the process exits 1; the frontend's
            # process watcher sees that at once (and restarts the core with fault tolerance).
            self.output_error = exc
            logger.error("engine core %d: the output thread failed; exiting\n%s",
                         self.engine_index, "".join(traceback.format_exception(exc)))
            self._on_output_failure()

    # -- lifecycle -------------------------------------------------------------------------------

    def start_core(self) -> bool:
        """Build the EngineCore and send the handshake; False (reason sent) on failure."""
        try:
            self.core = EngineCore(self.config, self._executor_class, self.engine_index,
                                   wake=lambda: self.input_queue.put(_WAKE))
            self.join_lockstep()
        except Exception as exc:  # reported to the frontend, which raises it
            # This process ends by itself now: the frontend's stop signal, which follows the
            # reply, must not raise at an arbitrary point of the teardown (inside a GC callback
            # it printed "Exception ignored ... _Shutdown" (core_main's) under the one-line
            # error).
            signal.signal(STOP_SIGNAL, signal.SIG_IGN)
            self.start_error = describe(exc)
            self.broadcast(HandshakeReply(ready=False, error=describe(exc),
                                          engine_index=self.engine_index, pid=os.getpid()))
            return False
        self.watch_executor()
        if self.greet_not_before is not None:
            time.sleep(max(0.0, self.greet_not_before - time.monotonic()))
        self.broadcast(HandshakeReply(
            ready=True, num_blocks=self.core.num_blocks,
            max_model_len=self.config.model_config.max_model_len,
            engine_index=self.engine_index, pid=os.getpid()))
        return True

    def watch_executor(self) -> None:
        """Have the core's (new) executor wake the busy loop when a worker dies."""
        assert self.core is not None
        executor = self.core.executor
        executor.register_failure_callback(
            lambda error: self.input_queue.put(_ExecutorFailed(error, executor)))

    def run_busy_loop(self) -> None:
        """Drain inputs (block only when idle), step, hand outputs off; until shutdown."""
        core = self.core
        if core is None:
            raise RuntimeError("start_core() must succeed before run_busy_loop()")
        if self.waves is not None:
            self.run_lockstep(core, self.waves)
        use_queue = core.batch_queue_size > 1
        while True:
            self._drain_inputs(block=not core.has_work())
            if use_queue:
                outputs, _ = core.step_with_batch_queue()
            else:
                outputs, _ = core.step()
            if outputs:
                self.send_outputs(outputs)

    def _drain_inputs(self, block: bool) -> None:
        if block:
            self._handle(self.input_queue.get())
        while True:
            try:
                message = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle(message)

    def _handle(self, message: CoreInput | _ExecutorFailed | _Wake | WaveStarted
                | PeerFaulted | _ClientGone | _OutputDied) -> None:
        core = self.core
        assert core is not None  # run_busy_loop checked it
        if message is _OUTPUT_DIED:
            _raise_output_died_once()
            return
        if message is _WAKE:
            return  # a grammar compiled: the loop's next step admits its request
        if isinstance(message, WaveStarted):
            if self.waves is not None:
                self.waves.note_wake(message.epoch, message.number)
            return
        if isinstance(message, PeerFaulted):
            if self.waves is not None and message.epoch == self.waves.epoch:
                raise PeerFault(f"the expert-parallel group failed: {message.reason}")
            return
        if isinstance(message, _ClientGone):
            core.abort_client(message.client)
            return
        if isinstance(message, _ExecutorFailed):
            if message.executor is core.executor:
                raise message.error  # an engine fault: the sentinel handles it
            return
        if isinstance(message, AddRequest):
            core.add_request(message.request)
        elif isinstance(message, AbortRequests):
            core.abort_requests(message.request_ids)
        elif isinstance(message, UtilityCall):
            if message.method == FAULT_INSTRUCTION_METHOD:
                raise FaultInstruction(message)  # the sentinel answers it
            if message.method == CORE_HUNG_METHOD:  # its requests already failed there
                raise DeclaredHung(str(message.args[0]) if message.args else "hung")
            if self.defer_to_wave_end(message):
                return
            if _holds_steps(message):
                # The steps in flight come back (run or skipped) before the pause applies.
                outputs = core.settle_hold()
                if outputs:
                    self.send_outputs(outputs)
            self._call_utility(core, message)

    def _call_utility(self, core: EngineCore, call: UtilityCall) -> None:
        """Run a utility call and answer it; one that broke the executor (a worker died,
        raised or hung in a call such as `sleep`) is also an engine fault, raised after the
        answer for the sentinel to handle."""
        fault: ExecutorError | None = None
        try:
            result = core.call_utility(call.method, call.args)
            reply = UtilityOutput(call.call_id, result=result)
        except Exception as exc:
            reply = UtilityOutput(call.call_id, failure_message=describe(exc))
            if isinstance(exc, ExecutorError):
                fault = exc
        self.send(call.client_index, EngineCoreOutputs(engine_index=self.engine_index,
                                                       utility_output=reply))
        if fault is not None:
            raise fault

    def fail_all(self, exc: BaseException) -> None:
        """Engine fault: end every request with ERROR and send the dead notice."""
        core = self.core
        if core is not None:
            core.batch_queue.clear()
            self.send_outputs(core.scheduler.abort_all(FinishReason.ERROR))
        self.broadcast(EngineCoreOutputs(
            engine_index=self.engine_index,
            utility_output=UtilityOutput(DEAD_CALL_ID, failure_message=describe(exc))))

    def close(self) -> None:
        """Flush the output thread, stop the core and the sockets."""
        self.output_queue.put(None)
        self._threads[1].join(timeout=5)
        if self.core is not None:
            self.core.shutdown()
        self.ctx.term()


def _holds_steps(call: UtilityCall) -> bool:
    """A pause that freezes or ends the requests in flight (keep, the core's default, or
    abort): the steps already queued for the workers are pointless."""
    if call.method != "pause":
        return False
    mode = call.args[0] if call.args else "keep"
    return mode in ("keep", "abort")
