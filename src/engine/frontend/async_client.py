"""The async (trio) client of engine-core processes: `AsyncMPClient` (`dp_client.py` adds
data-parallel routing).

Used by `AsyncLLM`. The client binds a ROUTER for requests (routing ids `core<i>`) and a PULL
for outputs, launches `data_parallel_size` core processes (`mp_client.CoreProcess`) and waits
for their handshakes off the event loop. zmq sockets are driven from trio without threads: a
socket's FD is edge-triggered, so a task retries its non-blocking call and, on EAGAIN, checks
`zmq.EVENTS` before parking in `trio.lowlevel.wait_readable(sock.FD)`. The output socket is
read by one task only (a frame that does not decode as `EngineCoreOutputs` is logged and
dropped). A send that meets a full pipe waits in its core's queue (`core_sender.py`), sent in
order before the core's next message; aborts are never dropped (an abort for a core being
restarted is moot). A core's death is seen at once through a pidfd, a hang by its silence
(`core_watch.py`).

Each core's fault-tolerance state (`fault_tolerance.EngineFaultState`) follows the
`FaultStatus` messages it publishes: an UNHEALTHY core is not dead (the client stays up and
new requests fail fast with `EngineRecoveringError`); a DEAD one makes the whole client dead.
A core process that exits is restarted when fault tolerance is on (`watch_cores`, in the
base `core_watch.CoreWatch`): its
requests fail at once, it is UNHEALTHY until the new process's handshake arrives on the
output socket (told apart from outputs by its tag), and the new process takes over the old
one's routing id (ROUTER_HANDOVER). With fault tolerance off, when the restart fails, or when
the core is crash-looping (restarted `RINGSERVE_CORE_RESTART_LIMIT` times within
`RINGSERVE_CORE_RESTART_WINDOW_S` already), the client is dead.
"""

from __future__ import annotations

import itertools
import logging
import shutil
from functools import partial
from typing import Any

import msgspec
import trio
import zmq

from ringserve import envs
from ringserve.config import EngineConfig
from ringserve.engine.errors import (
    RECOVERING_MESSAGE,
    EngineDeadError,
    EngineRecoveringError,
)
from ringserve.engine.frontend import lockstep_sleep
from ringserve.engine.frontend.core_sender import CoreSender, Queued, socket_events, socket_fd
from ringserve.engine.frontend.core_watch import CoreWatch, OnCoreDeath
from ringserve.engine.frontend.fault_tolerance import EngineFaultState, RestartBudget
from ringserve.engine.frontend.ipc_dir import make_ipc_dir
from ringserve.engine.frontend.mp_client import CoreProcess, wait_for_handshakes
from ringserve.engine.wire import (
    DEAD_CALL_ID,
    AbortRequests,
    AddRequest,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStatus,
    HandshakeReply,
    UtilityCall,
)
from ringserve.serial import MsgpackDecoder

logger = logging.getLogger(__name__)


class AsyncMPClient(CoreWatch):
    """A trio client of one or more engine-core processes.

    Create with `await AsyncMPClient.create(config)`; call `shutdown()` when done.

    Args:
        config: the engine configuration (`data_parallel_size` cores are started).
        executor: "default", "null" or "null-mp" (see `mp_client.CoreProcess`).
    """

    def __init__(self, config: EngineConfig, executor: str = "default") -> None:
        # A lockstep deployment (experts over several cores) meets in a store served here,
        # by the process that outlives its cores (`ringserve.engine.core.dp_wave`).
        self._store: Any = None
        if config.parallel_config.lockstep and self.hosts_lockstep:
            from ringserve.engine.core import dp_wave  # torch, only for this deployment

            self._store, config = dp_wave.serve_lockstep(config)
        self.config = config
        self.num_engines = config.parallel_config.data_parallel_size
        # Built first: a bad budget setting fails the start before any socket exists.
        self._restart_budgets = [RestartBudget() for _ in range(self.num_engines)]
        self.ctx = zmq.Context(io_threads=1)
        self.input_sock = self.ctx.socket(zmq.ROUTER)
        self.input_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A restarted core connects with its predecessor's routing id: it takes the id over.
        self.input_sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.input_sock.setsockopt(zmq.LINGER, 0)
        self.output_sock = self.ctx.socket(zmq.PULL)
        self.output_sock.setsockopt(zmq.LINGER, 0)
        self._dir: str | None = None
        self.input_addr, self.output_addr = self._bind_sockets()
        self._executor = executor
        self._sender = CoreSender(self.input_sock, self.num_engines, self._send_error)
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self._handshake_decoder = MsgpackDecoder(HandshakeReply)
        self._call_ids = itertools.count(1)
        self._calls: dict[int, tuple[trio.Event, list[Any]]] = {}
        self.processes: list[CoreProcess] = []
        self.dead: str | None = None
        self.fault_states = [EngineFaultState(i) for i in range(self.num_engines)]
        self._closed = False
        # Cores being restarted after their process died, and their handshake waiters.
        self.restarting: set[int] = set()
        # Cores silent for the hang timeout, and when each was last heard from (`core_watch`).
        self.hung: set[int] = set()
        self.heard_at: dict[int, float] = {}
        self._handshakes: dict[int, tuple[trio.Event, list[HandshakeReply]]] = {}
        self.restarts = [0] * self.num_engines
        # While `watch_cores` runs: its nursery and callback (for cores added later).
        self._watching: tuple[trio.Nursery, OnCoreDeath] | None = None
        self.num_blocks = 0
        self.max_model_len = config.model_config.max_model_len

    # This client starts its cores, so it serves their lockstep store (`dp_wave`).
    hosts_lockstep = True

    def _bind_sockets(self) -> tuple[str, str]:
        """Bind the request ROUTER and the output PULL; returns their addresses."""
        self._dir = make_ipc_dir()
        addrs = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self.input_sock.bind(addrs[0])
        self.output_sock.bind(addrs[1])
        return addrs

    @classmethod
    async def create(cls, config: EngineConfig, executor: str = "default") -> AsyncMPClient:
        """Start the core processes and wait (off the event loop) for their handshakes.

        Raises:
            EngineStartupError: a core failed to start; the message is its reason.
        """
        client = cls(config, executor)
        await client._start_off_loop()
        return client

    async def _start_off_loop(self) -> None:
        """`_start_cores` in a thread; a failure shuts the client down before it raises."""
        try:
            await trio.to_thread.run_sync(self._start_cores)
        except BaseException:
            self.shutdown()
            raise

    def _start_cores(self) -> None:
        for index in range(self.num_engines):
            self.processes.append(CoreProcess(self.config, index, self.input_addr,
                                              self.output_addr, self._executor))
        replies = wait_for_handshakes(self.output_sock, self.processes,
                                      envs.engine_ready_timeout_s())
        self.num_blocks = replies[-1].num_blocks

    # -- routing -------------------------------------------------------------------------------

    def choose_engine(self, request: EngineCoreRequest) -> int:
        """The core a new request goes to (one core: always 0)."""
        return 0

    def engine_of(self, request_id: str) -> int | None:
        """The core that owns a request (None: all cores may)."""
        return 0

    def request_finished(self, request_id: str) -> None:
        """Forget routing state of a finished or aborted request."""

    def record_stats(self, outputs: EngineCoreOutputs) -> None:
        """Take note of a core's published stats."""

    # -- sending -------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    @property
    def healthy(self) -> bool:
        """True while every core is healthy (and the client is not dead)."""
        return self.dead is None and all(state.healthy for state in self.fault_states)

    def check_accepting(self) -> None:
        """Raise unless a new request can be served.

        Raises:
            EngineDeadError: the engine is dead.
            EngineRecoveringError: no core is healthy (they are recovering from a fault).
        """
        self._check_alive()
        if not any(state.healthy for state in self.fault_states):
            faults = "; ".join(f"engine {s.id}: {s.fault_info}" for s in self.fault_states)
            raise EngineRecoveringError(f"{RECOVERING_MESSAGE} ({faults})")

    def send_nowait(self, engine: int, message: Any) -> bool:
        """One non-blocking send (after the core's queue); False, queuing nothing, when the
        core's pipe is full.

        Raises:
            EngineDeadError: the engine is dead.
            EngineRecoveringError: the core is being restarted (its process died); aborts
                for it are dropped instead (its requests ended with it).
        """
        self._check_alive()
        if engine in self.restarting:
            if isinstance(message, AbortRequests):
                return True
            raise EngineRecoveringError(f"{RECOVERING_MESSAGE} (engine core {engine} is "
                                        "being restarted)")
        if engine in self.hung and isinstance(message, AddRequest):
            raise EngineRecoveringError(f"{RECOVERING_MESSAGE} (engine core {engine} is hung)")
        try:
            return self._sender.try_send(engine, message)
        except zmq.ZMQError as exc:
            error = self._send_error(engine, exc)
            if isinstance(message, AbortRequests) and isinstance(error, EngineRecoveringError):
                return True  # the core is gone: its requests end with it
            raise error from exc

    def _send_error(self, engine: int, exc: zmq.ZMQError) -> BaseException:
        """What a failed send to `engine` means (the engine is dead unless it restarts)."""
        if exc.errno == zmq.EHOSTUNREACH and self._restarts_cores:
            # The core's process is gone and its watcher is about to restart it.
            return EngineRecoveringError(f"{RECOVERING_MESSAGE} (engine core {engine} is "
                                         "unreachable)")
        self.mark_dead(f"cannot reach engine core {engine}: {exc}")
        return EngineDeadError(self.dead or str(exc))

    async def send(self, engine: int, message: Any) -> None:
        """Send, waiting (parked, never polling) while the core's pipe is full.

        Raises:
            EngineDeadError, EngineRecoveringError: as `send_nowait`, also while waiting.
        """
        if self.send_nowait(engine, message):
            return
        item = self._sender.post(engine, message)
        await self._sender.wait(item)
        if item.error is not None:
            raise item.error

    async def add_request(self, request: EngineCoreRequest) -> None:
        """Route and send a new request."""
        await self.send(self.choose_engine(request), AddRequest(request))

    def abort_requests_nowait(self, request_ids: list[str]) -> bool:
        """Send aborts without waiting (usable from cancelled code); False when some met a full
        pipe: those are queued, never dropped, and go out before the core's next message and
        as soon as its pipe has room."""
        return not self._post_aborts(request_ids)

    async def abort_requests(self, request_ids: list[str]) -> None:
        """Send aborts to the owning cores, waiting while a pipe is full (cancelled, the
        aborts still go out)."""
        for item in self._post_aborts(request_ids):
            await self._sender.wait(item)

    def _post_aborts(self, request_ids: list[str]) -> list[Queued]:
        """Queue aborts for their owning cores (all cores for an unknown owner) and send what
        the pipes take now; returns the ones still queued."""
        if not request_ids or self.dead is not None:
            return []
        by_engine: dict[int | None, list[str]] = {}
        for rid in request_ids:
            by_engine.setdefault(self.engine_of(rid), []).append(rid)
            self.request_finished(rid)
        queued: list[Queued] = []
        for engine, ids in by_engine.items():
            for target in range(self.num_engines) if engine is None else (engine,):
                if target in self.restarting:
                    continue  # moot: the core's requests ended with its process
                item = self._sender.post(target, AbortRequests(ids), keep=True)
                if not item.done.is_set():
                    queued.append(item)
        return queued

    async def call_utility(self, method: str, *args: Any,
                           skip_restarting: bool = False) -> list[Any]:
        """Call a utility on every core; results in core order.

        Args:
            skip_restarting: leave out the cores being restarted (their process died and
                they come back by themselves) instead of raising EngineRecoveringError.

        `sleep` and `wake_up` of a lockstep deployment reach every core together, all or none
        (`lockstep_sleep`).

        Raises:
            ValueError: a core reported the call failed.
            EngineDeadError: the engine died meanwhile.
            EngineRecoveringError: a core is being restarted (unless skipped).
        """
        if method in lockstep_sleep.TOGETHER and self.config.parallel_config.lockstep:
            return await lockstep_sleep.call_together(
                partial(self._call_each, skip_restarting=skip_restarting), method, *args)
        return await self._call_each(method, *args, skip_restarting=skip_restarting)

    async def _call_each(self, method: str, *args: Any,
                         skip_restarting: bool = False) -> list[Any]:
        """`call_utility` on every core as it is (no lockstep agreement)."""
        call_id = next(self._call_ids)
        event, results = trio.Event(), list[Any]()
        self._calls[call_id] = (event, results)
        targets = [engine for engine in range(self.num_engines)  # elastic scaling may change it
                   if not (skip_restarting and engine in self.restarting)]
        try:
            for engine in targets:
                call = UtilityCall(call_id, method, list(args))
                if engine in self.hung:  # it reads the call once it runs again, if ever
                    self._sender.post(engine, call)
                    results.append((engine, self.fault_states[engine].fault_info
                                    or f"engine core {engine} is hung", None))
                else:
                    await self.send(engine, call)
            while len(results) < len(targets):
                await event.wait()
                event = trio.Event()
                self._calls[call_id] = (event, results)
                self._check_alive()
        finally:
            self._calls.pop(call_id, None)
        ordered = sorted(results, key=lambda item: item[0])
        for _engine, failure, _value in ordered:
            if failure is not None:
                raise ValueError(failure)
        return [value for _engine, _failure, value in ordered]

    # -- receiving -----------------------------------------------------------------------------

    async def get_output(self) -> EngineCoreOutputs:
        """The next batch of request outputs (utility answers are dispatched here).

        Raises:
            EngineDeadError: a core died or sent its dead notice.
        """
        sock = self.output_sock
        while True:
            self._check_alive()
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if not socket_events(sock) & zmq.POLLIN:
                    await trio.lowlevel.wait_readable(socket_fd(sock))
                continue
            buffers = [f.buffer for f in frames]
            try:
                outputs = self._decoder.decode(buffers)
            except (msgspec.MsgspecError, ValueError, TypeError) as exc:
                if not self._take_handshake(buffers):
                    logger.warning("dropped a malformed engine-core output frame: %s", exc)
                continue
            self.heard_from(outputs.engine_index)
            if outputs.utility_output is not None or outputs.fault_status is not None:
                self._dispatch_utility(outputs)  # a dead notice: the next turn raises
                self._record_fault_status(outputs)
                if not outputs.outputs:
                    continue
            self.record_stats(outputs)
            return outputs

    def _take_handshake(self, buffers: list[Any]) -> bool:
        """Hand a restarted core's handshake to its waiter; False if `buffers` is not one."""
        if len(buffers) != 1:
            return False
        try:
            reply = self._handshake_decoder.decode(buffers)
        except (msgspec.MsgspecError, ValueError, TypeError):
            return False
        self.heard_from(reply.engine_index)
        waiter = self._handshakes.get(reply.engine_index)
        if waiter is None:
            self._unexpected_handshake(reply)
        else:
            waiter[1].append(reply)
            waiter[0].set()
        return True

    def _close_more(self) -> None:
        """Close whatever else lives in the context before it is terminated."""

    def _unexpected_handshake(self, reply: HandshakeReply) -> None:
        logger.warning("dropped an unexpected handshake from engine core %d",
                       reply.engine_index)

    def _dispatch_utility(self, outputs: EngineCoreOutputs) -> None:
        utility = outputs.utility_output
        if utility is None:
            return
        if utility.call_id == DEAD_CALL_ID:
            self.mark_dead(f"engine core {outputs.engine_index} failed: {utility.failure_message}")
            return
        waiter = self._calls.get(utility.call_id)
        # A core called hung was answered for (`_call_each`): its late answer is not counted.
        if waiter is not None and not any(engine == outputs.engine_index
                                          for engine, _failure, _value in waiter[1]):
            waiter[1].append((outputs.engine_index, utility.failure_message, utility.result))
            waiter[0].set()

    def _record_fault_status(self, outputs: EngineCoreOutputs) -> None:
        status = outputs.fault_status
        if status is None or not 0 <= outputs.engine_index < self.num_engines:
            return
        self.fault_states[outputs.engine_index].update(status)
        if status.status == EngineStatus.DEAD:
            self.mark_dead(f"engine core {outputs.engine_index} is dead: "
                           f"{status.ft_error or status.fault_info}")

    def mark_dead(self, reason: str) -> None:
        """Record that the engine is dead; every later call raises EngineDeadError."""
        if self.dead is None:
            self.dead = reason
        for state in self.fault_states:
            state.mark_dead(self.dead)
        self._sender.close(EngineDeadError(self.dead))
        for event, _results in self._calls.values():
            event.set()

    def shutdown(self) -> None:
        """Stop the cores and close the sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.mark_dead("the engine was shut down")
        for proc in self.processes:  # all at once: lockstep cores wait on each other
            proc.signal_stop()
        for proc in self.processes:
            proc.terminate()
        self.input_sock.close(linger=0)
        self.output_sock.close(linger=0)
        self._close_more()
        self.ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._store = None  # stops serving
