"""`AttachedMPClient`: a frontend of a scaled-out deployment, attached to cores it did not start.

With `--api-server-count N` (or engines on other hosts) the supervisor of `ringserve serve`
(`ringserve.engine.cluster.fleet`) starts the engine cores and N frontend processes; each frontend
runs an `AsyncLLM` whose client is this one. It binds its ROUTER and PULL at the addresses the
`ClusterTopology` gives its client index (every core connects to every frontend), waits for a
handshake from every core, and then routes as `DPLBAsyncMPClient` does, with the DP
coordinator's load reports as a second source of queue lengths (they include what the other
frontends sent).

Cores are watched, not owned:

* a core on this host by its pid (a pidfd: its death is seen at once). The supervisor restarts
  it; this client fails the core's requests, marks it UNHEALTHY and waits, up to
  `RINGSERVE_ENGINE_READY_TIMEOUT_S`, for the new process's handshake;
* a core on another host (`topology.remote_engines`) by its link: it sends an empty batch
  every `heartbeat_s` when idle, and silence for `LOST_AFTER_BEATS` beats is a lost core.
  Its requests fail, it is reported UNHEALTHY, and this client waits as long as it takes for
  the headless host to restart it (the other cores keep serving meanwhile).

A core that declared itself DEAD (an `abort` instruction, or no instruction in time) makes
the whole client dead, as with `AsyncMPClient`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import trio
import zmq

from ringserve import envs
from ringserve.config import EngineConfig
from ringserve.engine.cluster.auth import ClusterAuth
from ringserve.engine.cluster.wire import ClusterTopology, LoadReport
from ringserve.engine.errors import EngineStartupError
from ringserve.engine.frontend.core_sender import recv_frame
from ringserve.engine.frontend.core_watch import OnCoreDeath
from ringserve.engine.frontend.dp_client import DPLBAsyncMPClient
from ringserve.engine.wire import EngineCoreOutputs, EngineStatus, FaultStatus, HandshakeReply

logger = logging.getLogger(__name__)

_POLL_MS = 100

@dataclass(frozen=True)
class Attachment:
    """What a frontend of a scaled-out deployment attaches with (`AsyncLLM(attach=...)`).

    Attributes:
        topology: the deployment's layout.
        client_index: this frontend's position in `topology.frontends`.
        auth: the deployment's link authentication (None: links are not authenticated).
    """

    topology: ClusterTopology
    client_index: int
    auth: ClusterAuth | None = None


class AttachedMPClient(DPLBAsyncMPClient):
    """The client of frontend `client_index` in a scaled-out deployment.

    Args:
        config: the engine configuration (the same on every frontend).
        topology: the deployment's layout.
        client_index: this frontend's position in `topology.frontends`.
        auth: the deployment's link authentication, or None.
    """

    hosts_lockstep = False  # the supervisor serves the store: it outlives frontends

    def __init__(self, config: EngineConfig, topology: ClusterTopology, client_index: int,
                 auth: ClusterAuth | None = None) -> None:
        self.topology = topology
        self.client_index = client_index
        self._auth = auth
        self._auth_started = False
        self._load_sock: zmq.Socket[Any] | None = None
        super().__init__(config)
        self.pids = [0] * self.num_engines
        # When each core was last heard from; set once every core has greeted (`_start_cores`).
        self.last_seen = [0.0] * self.num_engines
        self.load_seq = -1
        self._on_core_death: OnCoreDeath | None = None
        # Handshakes of cores beyond num_engines (started by an elastic scale-up, not yet
        # routed to), by index.
        self.greetings: dict[int, HandshakeReply] = {}
        if topology.coordinator_publish:
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            if auth is not None and topology.coordinator_publish.startswith("tcp://"):
                auth.secure_client(sock)
            sock.connect(topology.coordinator_publish)
            self._load_sock = sock
        self._load_decoder = msgspec.msgpack.Decoder(LoadReport)

    @classmethod
    async def attach(cls, config: EngineConfig, topology: ClusterTopology, client_index: int,
                     auth: ClusterAuth | None = None) -> AttachedMPClient:
        """Bind, then wait (off the event loop) for every core's handshake.

        Raises:
            EngineStartupError: a core reported it failed, or none came in time.
        """
        client = cls(config, topology, client_index, auth)
        await client._start_off_loop()
        return client

    def _bind_sockets(self) -> tuple[str, str]:
        addrs = self.topology.frontends[self.client_index]
        for sock, addr in ((self.input_sock, addrs.input_addr),
                           (self.output_sock, addrs.output_addr)):
            if self._auth is not None and addr.startswith("tcp://"):
                if not self._auth_started:
                    self._auth.start(self.ctx)
                    self._auth_started = True
                self._auth.secure_server(sock)
            sock.bind(addr)
        return addrs.input_addr, addrs.output_addr

    def _start_cores(self) -> None:
        """Wait for a handshake from every core (they connect by themselves)."""
        timeout = envs.engine_ready_timeout_s()
        deadline = time.monotonic() + timeout
        replies: dict[int, HandshakeReply] = {}
        decoder = msgspec.msgpack.Decoder(HandshakeReply)
        while len(replies) < self.num_engines:
            if time.monotonic() >= deadline:
                missing = sorted(set(range(self.num_engines)) - set(replies))
                raise EngineStartupError(
                    f"engine cores {missing} did not become ready within {timeout:.0f} s "
                    "(RINGSERVE_ENGINE_READY_TIMEOUT_S)")
            if not self.output_sock.poll(_POLL_MS):
                continue
            frames = self.output_sock.recv_multipart()
            try:
                reply = decoder.decode(frames[0]) if len(frames) == 1 else None
            except (msgspec.MsgspecError, ValueError, TypeError):
                reply = None
            if reply is None:
                continue  # an output or a fault status sent before this frontend attached
            if not reply.ready:
                raise EngineStartupError(f"engine core failed to start: {reply.error}")
            replies[reply.engine_index] = reply
        for index, reply in replies.items():
            self.pids[index] = reply.pid
        # Silence is counted from here, never from this frontend's start: a headless host may
        # join minutes after the head (its core would be "silent" since then and called lost
        # at once), and the beats of the cores that greeted earlier were not read while this
        # waited for the others.
        self.last_seen[:] = [time.monotonic()] * self.num_engines
        self.num_blocks = replies[self.num_engines - 1].num_blocks

    def _unexpected_handshake(self, reply: HandshakeReply) -> None:
        # A core greets every frontend that (re)connects: a second greeting is expected.
        index = reply.engine_index
        if index >= self.num_engines:
            self.greetings[index] = reply  # a new core of an elastic scale-up
            return
        if not (0 <= index < self.num_engines and reply.ready):
            return
        self.last_seen[index] = time.monotonic()
        old = self.pids[index]
        if (reply.pid != old and index in self.topology.remote_engines
                and index not in self.restarting and self._on_core_death is not None):
            # A new process took the rank over before its predecessor's silence was long
            # enough to call it lost (its host's supervisor waits that long before the new
            # one greets; another start of the host need not): the predecessor's requests
            # and utility calls are gone with it, and the successor serves at once.
            fault = f"engine core {index} on another host was replaced (pid {old} -> {reply.pid})"
            logger.error("%s", fault)
            self._core_lost(index, fault)
            self._on_core_death(index, fault)
            self._rejoined(index, reply)

    def record_stats(self, outputs: EngineCoreOutputs) -> None:
        if 0 <= outputs.engine_index < self.num_engines:
            self.last_seen[outputs.engine_index] = time.monotonic()
        super().record_stats(outputs)

    # -- the coordinator -----------------------------------------------------------------------

    async def watch_cores(self, on_core_death: OnCoreDeath) -> None:
        self._on_core_death = on_core_death
        async with trio.open_nursery() as nursery:
            if self._load_sock is not None:
                nursery.start_soon(self._follow_loads, self._load_sock)
            await super().watch_cores(on_core_death)
            nursery.cancel_scope.cancel()

    async def _follow_loads(self, sock: zmq.Socket[Any]) -> None:
        while True:
            try:
                frame = await recv_frame(sock)
            except zmq.ZMQError:
                return  # closed by shutdown
            try:
                report = self._load_decoder.decode(frame)
            except (msgspec.MsgspecError, ValueError, TypeError) as exc:
                logger.warning("dropped a malformed load report: %s", exc)
                continue
            self.apply_load_report(report)

    def apply_load_report(self, report: LoadReport) -> None:
        """Take every core's queue lengths from a coordinator report (newer ones only)."""
        if report.seq <= self.load_seq:
            return
        self.load_seq = report.seq
        # While an elastic scale settles, a report may cover more or fewer cores than this
        # frontend routes to: the ones it has are taken.
        for engine, (waiting, running) in enumerate(report.loads[:self.num_engines]):
            self._stats[engine] = [waiting, running]
            self._sent_since_stats[engine] = 0

    # -- elastic scaling (`ringserve.engine.cluster.elastic_cluster`) -----------------------------------

    def adopt(self, indexes: list[int]) -> None:
        """Route to these new cores (indexes num_engines.., in order; each has greeted)."""
        for index in indexes:
            assert index == self.num_engines, "cores are added in index order"
            self.pids.append(self.greetings.pop(index).pid)
            self.last_seen.append(time.monotonic())
            self._grow()

    def _per_core(self) -> list[list[Any]]:
        return [*super()._per_core(), self.pids, self.last_seen]

    # -- watching cores ------------------------------------------------------------------------

    def watches_silence(self, index: int) -> bool:
        return index not in self.topology.remote_engines  # those are watched by their link

    async def _watch_core(self, index: int, on_core_death: OnCoreDeath,
                          scope: trio.CancelScope) -> None:
        remote = index in self.topology.remote_engines
        # Each core's fault state is made when it joins: another one at this index is a
        # successor of an elastic scale-down and up, watched by its own task.
        state = self.fault_states[index]
        while index < self.num_engines:  # else it left (elastic scale-down)
            reason = await (self._link_lost(index) if remote else self._pid_exited(index))
            if self._closed:
                scope.cancel()
                return
            if index >= self.num_engines or self.fault_states[index] is not state:
                return  # it left; a later scale-up watches its successor itself
            if self.dead is None and not self._declared_dead(index):
                fault = f"{reason}; waiting for it to rejoin"
                logger.error("%s", fault)
                self._core_lost(index, fault)
                on_core_death(index, fault)
                failure = await self._await_rejoin(index, remote)
                if failure is None:
                    continue
                reason = f"{reason}; {failure}"
            self.mark_dead(reason)
            on_core_death(index, reason)
            scope.cancel()
            return

    async def _pid_exited(self, index: int) -> str:
        pid = self.pids[index]
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return f"engine core {index} (pid {pid}) exited"
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)
        return f"engine core {index} (pid {pid}) exited"

    async def _link_lost(self, index: int) -> str:
        limit = self.topology.lost_after_s
        while True:
            silent = time.monotonic() - self.last_seen[index]
            if silent > limit:
                return f"engine core {index} on another host was silent for {silent:.1f} s"
            await trio.sleep(self.topology.heartbeat_s)

    async def _await_rejoin(self, index: int, remote: bool) -> str | None:
        """Wait for the core's new handshake (its supervisor restarts it); None once it is
        back, else why it is not."""
        event, replies = trio.Event(), list[HandshakeReply]()
        self._handshakes[index] = (event, replies)
        timeout = float("inf") if remote else envs.engine_ready_timeout_s()
        try:
            with trio.move_on_after(timeout):
                while True:
                    await event.wait()
                    if replies and replies[-1].ready:
                        break
                    event = trio.Event()
                    self._handshakes[index] = (event, replies)
        finally:
            self._handshakes.pop(index, None)
        if not replies or not replies[-1].ready:
            return (f"no new engine core was ready within {timeout:.0f} s "
                    "(RINGSERVE_ENGINE_READY_TIMEOUT_S)")
        self._rejoined(index, replies[-1])
        return None

    def _rejoined(self, index: int, reply: HandshakeReply) -> None:
        """Serve with the core's new process from now on (its restart is counted)."""
        self.pids[index] = reply.pid
        self.last_seen[index] = time.monotonic()
        self.restarts[index] += 1
        self.restarting.discard(index)
        self.fault_states[index].update(FaultStatus(EngineStatus.HEALTHY))
        logger.warning("engine core %d rejoined", index)

    def _close_more(self) -> None:
        if self._load_sock is not None:
            self._load_sock.close(linger=0)
        if self._auth is not None and self._auth_started:
            self._auth.stop()
