"""Elastic data parallelism in a scaled-out deployment (several API servers on one host).

The supervisor of `ringserve serve` owns the engine cores, so a scale is the supervisor's
(`ScaleService`). An API server asked to scale (`AsyncLLM.prepare_elastic_dp` /
`commit_elastic_dp` / `cancel_elastic_dp`, or `POST /scale_elastic_dp`) checks what it can
(`elastic_dp`: sleep, pause, health) and sends the phase to the supervisor (`ScaleCall`, REQ to
the topology's `control_addr`), which answers once the phase is done on every API server. The
supervisor drives every API server's agent (`serve_agent`: a REP on its
`FrontendAddrs.control_addr`) with `AgentCall`s:

- prepare, scale-up: the fleet starts the new cores, connected to every API server; each
  agent waits until every new core has greeted it (`expect`). A core that exits or an agent
  that does not see it ready in time fails the prepare: the agents forget the greetings
  (`drop`) and the cores are stopped.
- commit, scale-up: each agent routes to the new cores (`add`), the fleet keeps them running,
  and the topology (what a restarted API server or core is told) has the new size.
- commit, scale-down: each agent stops routing new requests to the leaving cores and waits
  for its own requests on them (`drain`, all at once); when every agent has drained, each one
  forgets the leaving cores (`remove`) and the fleet stops them. An agent whose drain timed
  out (or failed) makes every agent route to them again (`restore`): rolled back.
- cancel: `drop`, then the prepared cores are stopped.

One scale at a time: a second `ScaleCall` while one runs is answered "busy" at once.
Engines on other hosts (`--headless`, `-dpl`) have no `control_addr`: there, scaling is
refused by the API server (`elastic_dp`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
import trio
import zmq

from ringserve import envs
from ringserve.config import EngineConfig
from ringserve.engine.cluster.wire import ClusterTopology
from ringserve.engine.frontend.core_sender import recv_frame, socket_events, socket_fd
from ringserve.engine.frontend.dp_client import stop_cores
from ringserve.engine.frontend.mp_client import CoreProcess

if TYPE_CHECKING:
    from ringserve.engine.cluster.fleet import EngineFleet

logger = logging.getLogger(__name__)

_AGENT_SLACK_S = 10.0  # how much longer than its own work an agent may take to answer


def resized(config: EngineConfig, size: int) -> EngineConfig:
    """`config` with `size` data-parallel ranks."""
    parallel = dataclasses.replace(config.parallel_config, data_parallel_size=size)
    return dataclasses.replace(config, parallel_config=parallel)


class ScaleCall(msgspec.Struct, array_like=True):
    """An API server -> the supervisor: run one phase ("prepare", "commit" or "cancel")."""

    phase: str
    new_size: int = 0
    drain_timeout: float = 0.0


class ScaleAnswer(msgspec.Struct, array_like=True, omit_defaults=True):
    """The supervisor's answer: `kind` "" (done), "refused", "busy", "timeout" (a drain,
    rolled back) or "failed" (rolled back), and why."""

    kind: str = ""
    error: str = ""


class AgentCall(msgspec.Struct, array_like=True):
    """The supervisor -> an API server's agent (see the module docstring)."""

    op: str
    indexes: list[int] = []
    size: int = 0
    timeout: float = 0.0


class AgentAnswer(msgspec.Struct, array_like=True, omit_defaults=True):
    """An agent's answer: "" when done, else why not."""

    error: str = ""


# -- zmq from trio ---------------------------------------------------------------------------------


async def _recv_multipart(sock: zmq.Socket[Any]) -> list[bytes]:
    while True:
        try:
            frames: list[bytes] = sock.recv_multipart(flags=zmq.NOBLOCK)
            return frames
        except zmq.Again:
            if not socket_events(sock) & zmq.POLLIN:
                await trio.lowlevel.wait_readable(socket_fd(sock))


async def request(ctx: zmq.Context[Any], addr: str, payload: bytes, timeout: float) -> bytes | None:
    """One request over a fresh REQ socket; the reply, or None after `timeout` seconds."""
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        sock.send(payload, flags=zmq.NOBLOCK)  # queued on the connecting pipe
        with trio.move_on_after(timeout):
            return await recv_frame(sock)
        return None
    finally:
        sock.close(linger=0)


# -- the API server's side -------------------------------------------------------------------------


async def call_supervisor(client: Any, call: ScaleCall, timeout: float) -> ScaleAnswer:
    """Send a phase to the supervisor and wait for its answer (at most `timeout` s)."""
    topology: ClusterTopology = client.topology
    reply = await request(client.ctx, topology.control_addr, msgspec.msgpack.encode(call),
                          timeout)
    if reply is None:
        return ScaleAnswer("failed", f"the supervisor did not answer within {timeout:.0f} s")
    return msgspec.msgpack.decode(reply, type=ScaleAnswer)


async def serve_agent(llm: Any) -> None:
    """Answer the supervisor's `AgentCall`s for this API server until cancelled."""
    client = llm.client
    addr = client.topology.frontends[client.client_index].control_addr
    sock = client.ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    decoder = msgspec.msgpack.Decoder(AgentCall)
    try:
        while True:
            try:
                frame = await recv_frame(sock)
            except zmq.ZMQError:
                return  # the client's context is closing
            try:
                call = decoder.decode(frame)
                error = await _agent_step(llm, call)
            except (msgspec.MsgspecError, ValueError, TypeError) as exc:
                error = f"bad agent call: {exc}"
            sock.send(msgspec.msgpack.encode(AgentAnswer(error)))
    finally:
        sock.close(linger=0)


async def _agent_step(llm: Any, call: AgentCall) -> str:
    client = llm.client
    if call.op == "expect":
        deadline = time.monotonic() + call.timeout
        while True:
            missing = [i for i in call.indexes if i not in client.greetings]
            failed = [client.greetings[i] for i in call.indexes
                      if i in client.greetings and not client.greetings[i].ready]
            if failed:
                return f"engine core {failed[0].engine_index} failed to start: {failed[0].error}"
            if not missing:
                return ""
            if time.monotonic() >= deadline:
                return (f"engine cores {missing} did not greet API server {client.client_index} "
                        f"within {call.timeout:.0f} s")
            await trio.sleep(0.01)
    if call.op == "drop":
        for index in call.indexes:
            client.greetings.pop(index, None)
        return ""
    if call.op == "add":
        client.adopt(call.indexes)
        llm.elastic_resized(call.size)
        return ""
    if call.op == "drain":
        client.routable = call.size
        deadline = time.monotonic() + call.timeout
        while client.owned_from(call.size):
            if time.monotonic() >= deadline:
                return (f"API server {client.client_index} still had "
                        f"{client.owned_from(call.size)} request(s) on engine cores "
                        f"{call.size}.. after {call.timeout:g} s")
            await trio.sleep(0.01)
        return ""
    if call.op == "restore":
        client.routable = client.num_engines
        return ""
    if call.op == "remove":
        client.remove_cores(call.size)
        llm.elastic_resized(call.size)
        return ""
    return f"unknown agent op {call.op!r}"


# -- the supervisor's side -------------------------------------------------------------------------


class ScaleService:
    """The supervisor's end (see the module docstring).

    Args:
        fleet: this host's engine cores.
        on_resized: called with the new config and topology once a scale is committed (the
            supervisor re-tells restarted API servers).
    """

    def __init__(self, fleet: EngineFleet, on_resized: Any) -> None:
        self.fleet = fleet
        self.on_resized = on_resized
        self.ctx: zmq.Context[Any] = zmq.Context.instance()
        self.busy = False
        self.pending: list[CoreProcess] = []
        self.planned: int | None = None

    @property
    def size(self) -> int:
        return self.fleet.topology.data_parallel_size

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve `ScaleCall`s on the topology's `control_addr` until cancelled."""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.fleet.topology.control_addr)
        task_status.started()
        decoder = msgspec.msgpack.Decoder(ScaleCall)
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    frames = await _recv_multipart(sock)
                    if len(frames) != 3:
                        continue
                    nursery.start_soon(self._answer, sock, frames[0], frames[2], decoder)
        finally:
            sock.close(linger=0)
            with trio.CancelScope(shield=True):
                await stop_cores(self.pending)

    async def _answer(self, sock: zmq.Socket[Any], peer: bytes, frame: bytes,
                      decoder: msgspec.msgpack.Decoder[ScaleCall]) -> None:
        try:
            call = decoder.decode(frame)
        except (msgspec.MsgspecError, ValueError, TypeError) as exc:
            answer = ScaleAnswer("refused", f"malformed scale call: {exc}")
        else:
            if self.busy:
                answer = ScaleAnswer("busy", "a scale is in progress")
            else:
                self.busy = True
                try:
                    answer = await self._phase(call)
                finally:
                    self.busy = False
        sock.send_multipart([peer, b"", msgspec.msgpack.encode(answer)])

    async def _phase(self, call: ScaleCall) -> ScaleAnswer:
        if call.phase == "prepare":
            return await self._prepare(call.new_size)
        if call.phase == "cancel":
            await self._cancel()
            return ScaleAnswer()
        if call.phase == "commit":
            if self.planned is None:
                return ScaleAnswer("refused", "no scale is prepared: call "
                                   "prepare_elastic_dp(n) first")
            new, self.planned = self.planned, None
            if new > self.size:
                return await self._commit_up(new)
            if new < self.size:
                return await self._commit_down(new, call.drain_timeout)
            return ScaleAnswer()
        return ScaleAnswer("refused", f"unknown phase {call.phase!r}")

    async def _agents(self, call: AgentCall, timeout: float) -> list[str]:
        """Send `call` to every API server's agent at once; their errors (none: all done)."""
        errors: list[str] = []
        payload = msgspec.msgpack.encode(call)

        async def one(index: int, addr: str) -> None:
            reply = await request(self.ctx, addr, payload, timeout + _AGENT_SLACK_S)
            if reply is None:
                errors.append(f"API server {index} did not answer {call.op!r}")
                return
            error = msgspec.msgpack.decode(reply, type=AgentAnswer).error
            if error:
                errors.append(error)

        async with trio.open_nursery() as nursery:
            for index, front in enumerate(self.fleet.topology.frontends):
                nursery.start_soon(one, index, front.control_addr)
        return errors

    def _resized(self, size: int) -> tuple[EngineConfig, ClusterTopology]:
        topology = msgspec.structs.replace(self.fleet.topology, data_parallel_size=size)
        return resized(self.fleet.config, size), topology

    async def _prepare(self, size: int) -> ScaleAnswer:
        if self.planned is not None:
            return ScaleAnswer("busy", f"a scale to {self.planned} is prepared: commit or "
                               "cancel it first")
        old = self.size
        if size > old:
            config, topology = self._resized(size)
            ranks = list(range(old, size))
            try:
                self.pending = await trio.to_thread.run_sync(
                    self.fleet.start_cores, ranks, config, topology)
            except OSError as exc:
                return ScaleAnswer("failed", f"cannot start an engine core: {exc}; the "
                                   f"deployment stays at {old} engine core(s)")
            timeout = envs.engine_ready_timeout_s()
            errors: list[str] = []
            async with trio.open_nursery() as nursery:
                async def exited(proc: CoreProcess) -> None:
                    await trio.to_thread.run_sync(proc.exited.wait, abandon_on_cancel=True)
                    errors.append(f"engine core {proc.engine_index} {proc.describe_exit()} "
                                  "before it was ready")
                    nursery.cancel_scope.cancel()

                for proc in self.pending:
                    nursery.start_soon(exited, proc)
                errors += await self._agents(AgentCall("expect", ranks, timeout=timeout),
                                             timeout)
                nursery.cancel_scope.cancel()
            if errors:
                await self._cancel(ranks)
                return ScaleAnswer("failed", f"{errors[0]}; the deployment stays at {old} "
                                   "engine core(s)")
        self.planned = size
        return ScaleAnswer()

    async def _cancel(self, ranks: list[int] | None = None) -> None:
        self.planned = None
        if ranks is None:
            ranks = [proc.engine_index for proc in self.pending]
        if ranks:
            await self._agents(AgentCall("drop", ranks), 5.0)
        await stop_cores(self.pending)
        self.pending = []

    async def _commit_up(self, size: int) -> ScaleAnswer:
        old = self.size
        dead = [proc for proc in self.pending if proc.exited.is_set()]
        if dead:
            await self._cancel()
            return ScaleAnswer("failed", f"engine core {dead[0].engine_index} "
                               f"{dead[0].describe_exit()} after it was prepared; the "
                               f"deployment stays at {old} engine core(s)")
        config, topology = self._resized(size)
        procs, self.pending = self.pending, []
        self.fleet.adopt(procs, config, topology)
        self.on_resized(config, topology)
        errors = await self._agents(AgentCall("add", [p.engine_index for p in procs],
                                              size=size), 5.0)
        if errors:  # an API server that missed it is out of step: say so, do not undo
            logger.error("scale-up to %d: %s", size, "; ".join(errors))
        logger.info("scaled up to %d engine cores", size)
        return ScaleAnswer()

    async def _commit_down(self, size: int, drain_timeout: float) -> ScaleAnswer:
        old = self.size
        errors = await self._agents(AgentCall("drain", size=size, timeout=drain_timeout),
                                    drain_timeout)
        if errors:
            await self._agents(AgentCall("restore"), 5.0)
            return ScaleAnswer("timeout", f"{errors[0]} (drain_timeout); the scale-down was "
                               f"rolled back: the deployment stays at {old} engine cores")
        config, topology = self._resized(size)
        gone = self.fleet.release(list(range(size, old)), config, topology)
        self.on_resized(config, topology)
        errors = await self._agents(AgentCall("remove", size=size), 5.0)
        if errors:
            logger.error("scale-down to %d: %s", size, "; ".join(errors))
        await stop_cores(gone)
        logger.info("scaled down to %d engine core(s)", size)
        return ScaleAnswer()

