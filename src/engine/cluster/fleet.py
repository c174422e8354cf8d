"""The engine side of a scaled-out deployment: its layout and this host's engine cores.

`ringserve serve` scales out when it runs more than one API server (`--api-server-count`),
or engines on other hosts (`--data-parallel-size-local` below `--data-parallel-size`), or is
such a host itself (`--headless`). Then its supervisor (`ringserve.http.scaleout`) owns:

* the layout, `ClusterTopology` (`build_topology`): per frontend a ROUTER and a PULL address,
  ipc:// in a private directory when everything runs on this host, else tcp:// on
  `--data-parallel-address`; the coordinator's two addresses; which engines are remote;
* `EngineFleet`: this host's engine cores (ranks `start_rank ..` `start_rank + local - 1`), each
  connected to every frontend, restarted when its process dies (fault tolerance on, within
  the restart budget), plus, on the head, the DP coordinator process (when DP > 1 or more
  than one API server), the lockstep store (experts over several cores) and the join
  service headless hosts ask for the topology (`JoinRequest` on
  `--data-parallel-address:--data-parallel-rpc-port`).

Frontends watch the cores themselves (`attached_client`); the fleet only keeps them running.
A core that cannot be restarted (fault tolerance off, crash loop) ends the fleet's `run` with
`EngineDeadError`, which stops the deployment.
"""

from __future__ import annotations

import logging
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import trio
import zmq

from ringserve.config import EngineConfig
from ringserve.engine.cluster.wire import (
    STARTUP_FAILED_SETTING_STATUS,
    STARTUP_FAILED_STATUS,
    ClusterTopology,
    FrontendAddrs,
    JoinReply,
    JoinRequest,
)
from ringserve.engine.errors import EngineDeadError, EngineStartupError
from ringserve.engine.frontend.core_sender import recv_frame
from ringserve.engine.frontend.fault_tolerance import RestartBudget
from ringserve.engine.frontend.ipc_dir import make_ipc_dir
from ringserve.engine.frontend.mp_client import ChildProcess, CoreProcess

logger = logging.getLogger(__name__)

DEFAULT_RPC_PORT = 29550  # vLLM's --data-parallel-rpc-port default
_JOIN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ClusterSettings:
    """The deployment flags (vLLM's names and meanings).

    Attributes:
        api_server_count: frontend processes (None: the data-parallel size).
        headless: run engine cores only; they join the head at `data_parallel_address`.
        data_parallel_size_local: engine cores on this host (None: all of them).
        data_parallel_address: the head's address (its frontends and join service).
        data_parallel_rpc_port: the head's join-service port.
        data_parallel_start_rank: the first engine rank of this host.
        cluster_secret_file: the shared-secret file that authenticates links between hosts.
        insecure_cluster: allow unauthenticated links on non-loopback addresses.
    """

    api_server_count: int | None = None
    headless: bool = False
    data_parallel_size_local: int | None = None
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = DEFAULT_RPC_PORT
    data_parallel_start_rank: int = 0
    cluster_secret_file: str | None = None
    insecure_cluster: bool = False

    def frontends(self, config: EngineConfig) -> int:
        """The number of API servers."""
        if self.api_server_count is not None:
            return self.api_server_count
        return config.parallel_config.data_parallel_size

    def local_engines(self, config: EngineConfig) -> int:
        """The number of engine cores on this host."""
        size = config.parallel_config.data_parallel_size
        return size if self.data_parallel_size_local is None else self.data_parallel_size_local

    def scaled_out(self, config: EngineConfig) -> bool:
        """True when the deployment needs the scaled-out supervisor: more than one API server
        or engine core (the DP coordinator is a process then, as in vLLM), or engines on
        other hosts."""
        size = config.parallel_config.data_parallel_size
        return (self.headless or self.frontends(config) > 1 or size > 1
                or self.local_engines(config) < size)

    def check(self, config: EngineConfig) -> None:
        """Refuse inconsistent flags, naming them.

        Raises:
            ValueError: what is wrong and what is allowed.
        """
        size = config.parallel_config.data_parallel_size
        if self.api_server_count is not None and self.api_server_count < 1:
            raise ValueError(f"--api-server-count: got {self.api_server_count}, allowed: >= 1")
        local = self.local_engines(config)
        if not 0 <= local <= size:
            raise ValueError(f"--data-parallel-size-local: got {local}, allowed: 0.."
                             f"{size} (--data-parallel-size)")
        start = self.data_parallel_start_rank
        if start < 0 or start + local > size:
            raise ValueError(f"--data-parallel-start-rank: got {start}; with "
                             f"--data-parallel-size-local {local} the ranks must lie in "
                             f"0..{size - 1}")
        if self.headless and local < 1:
            raise ValueError("--headless: --data-parallel-size-local must be >= 1 "
                             "(the engine cores this host runs)")
        if not self.headless and start != 0:
            raise ValueError("--data-parallel-start-rank: only a --headless host starts at "
                             "a rank above 0 (the head runs ranks 0..)")
        if not 1 <= self.data_parallel_rpc_port <= 65535:
            raise ValueError(f"--data-parallel-rpc-port: got {self.data_parallel_rpc_port}, "
                             "allowed: 1..65535")


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def build_topology(config: EngineConfig, cluster: ClusterSettings,
                   run_dir: str) -> ClusterTopology:
    """The layout the head hands to every process (see the module docstring)."""
    size = config.parallel_config.data_parallel_size
    local = cluster.local_engines(config)
    remote = list(range(local, size))
    host = cluster.data_parallel_address
    frontends = []
    for index in range(cluster.frontends(config)):
        if remote:
            frontends.append(FrontendAddrs(_tcp(host, _free_port(host)),
                                           _tcp(host, _free_port(host))))
        else:
            frontends.append(FrontendAddrs(f"ipc://{run_dir}/fe{index}-in",
                                           f"ipc://{run_dir}/fe{index}-out",
                                           f"ipc://{run_dir}/fe{index}-ctl"))
    coord_in = coord_pub = ""
    if size > 1 or len(frontends) > 1:  # several API servers: ready for an elastic scale-up
        if remote:
            coord_in, coord_pub = _tcp(host, _free_port(host)), _tcp(host, _free_port(host))
        else:
            coord_in, coord_pub = f"ipc://{run_dir}/coord-in", f"ipc://{run_dir}/coord-pub"
    control = "" if remote else f"ipc://{run_dir}/scale"
    return ClusterTopology(frontends, size, coord_in, coord_pub, remote, control_addr=control)


def tcp_addresses(topology: ClusterTopology) -> list[str]:
    """Every tcp:// address of the layout (what link authentication must cover)."""
    addrs = [a for f in topology.frontends for a in (f.input_addr, f.output_addr)]
    addrs += [topology.coordinator_input, topology.coordinator_publish]
    return [a for a in addrs if a.startswith("tcp://")]


class EngineFleet:
    """This host's engine cores, and on the head the coordinator and the join service.

    Args:
        config: the engine configuration.
        cluster: the deployment flags.
        topology: the layout (the head's own, or the one a headless host was given).
        executor: "default", or "null" / "null-mp" (tests and benchmarks).
        secure_server: makes a bound TCP socket a CURVE server (link auth), or None.
    """

    def __init__(self, config: EngineConfig, cluster: ClusterSettings,
                 topology: ClusterTopology, executor: str = "default",
                 secure_server: Callable[[zmq.Socket[Any]], None] | None = None) -> None:
        self.config = config
        self.cluster = cluster
        self.topology = topology
        self.executor = executor
        self._secure_server = secure_server
        start = cluster.data_parallel_start_rank
        self.ranks = list(range(start, start + cluster.local_engines(config)))
        self.cores: dict[int, CoreProcess] = {}
        self.coordinator: ChildProcess | None = None
        self.budgets = {rank: RestartBudget() for rank in self.ranks}
        self.restarts = dict.fromkeys(self.ranks, 0)
        self._store: Any = None
        self._closed = False
        self._nursery: trio.Nursery | None = None

    def serve_lockstep(self) -> None:
        """On the head of a lockstep deployment: serve the store the cores meet in (it
        outlives every core, so it lives here) and name its port in the config."""
        if self.config.parallel_config.lockstep:
            from ringserve.engine.core import dp_wave

            self._store, self.config = dp_wave.serve_lockstep(self.config)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Start the coordinator and the cores, then keep them running until `stop()`.

        Raises:
            EngineDeadError: a core died and cannot be restarted.
            EngineStartupError: a core could not start (it is not restarted).
        """
        topology = self.topology
        if not self.cluster.headless and topology.coordinator_input:
            self.coordinator = self._start_coordinator()
        await trio.to_thread.run_sync(self._start_cores)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if not self.cluster.headless and topology.remote_engines:
                await nursery.start(self._serve_joins)
            for rank in self.ranks:
                nursery.start_soon(self._keep_core, rank)
            if self.coordinator is not None:
                nursery.start_soon(self._keep_coordinator)
            task_status.started()

    # -- elastic scaling (`ringserve.engine.cluster.elastic_cluster`) -----------------------------------

    def start_cores(self, ranks: list[int], config: EngineConfig,
                    topology: ClusterTopology) -> list[CoreProcess]:
        """Start cores for new ranks (blocking); not kept running until `adopt`."""
        addrs = topology.client_addrs
        return [CoreProcess(config, rank, [a for a, _ in addrs], [b for _, b in addrs],
                            self.executor, topology) for rank in ranks]

    def adopt(self, procs: list[CoreProcess], config: EngineConfig,
              topology: ClusterTopology) -> None:
        """Keep these new cores running from now on; the deployment has the new size."""
        self.config, self.topology = config, topology
        for proc in procs:
            rank = proc.engine_index
            self.cores[rank] = proc
            self.ranks.append(rank)
            self.budgets[rank] = RestartBudget()
            self.restarts[rank] = 0
            assert self._nursery is not None  # run() is running
            self._nursery.start_soon(self._keep_core, rank)

    def release(self, ranks: list[int], config: EngineConfig,
                topology: ClusterTopology) -> list[CoreProcess]:
        """Stop keeping these cores (they leave: their exit is no fault); the caller stops
        them. The deployment has the new size."""
        self.config, self.topology = config, topology
        gone = []
        for rank in ranks:
            proc = self.cores.pop(rank)
            proc.retiring = True
            gone.append(proc)
            self.ranks.remove(rank)
        return gone

    def _start_cores(self) -> None:
        for rank in self.ranks:
            self.cores[rank] = self._core(rank)

    def _core(self, rank: int, greet_not_before: float | None = None) -> CoreProcess:
        addrs = self.topology.client_addrs
        return CoreProcess(self.config, rank, [a for a, _ in addrs], [b for _, b in addrs],
                           self.executor, self.topology, greet_not_before)

    def _start_coordinator(self) -> ChildProcess:
        topology = self.topology
        cmd = [sys.executable, "-m", "ringserve.engine.cluster.coordinator",
               "--data-parallel-size", str(topology.data_parallel_size),
               "--input-addr", topology.coordinator_input,
               "--publish-addr", topology.coordinator_publish]
        return ChildProcess(cmd, b"", "coordinator")

    async def _wait_exit(self, proc: ChildProcess) -> None:
        await trio.to_thread.run_sync(proc.exited.wait, abandon_on_cancel=True)

    async def _keep_core(self, rank: int) -> None:
        while True:
            proc = self.cores[rank]
            await self._wait_exit(proc)
            if self._closed or proc.retiring:
                return
            reason = f"engine core {rank} {proc.describe_exit()}"
            proc.lifeline.cut()
            if proc.proc.returncode == STARTUP_FAILED_SETTING_STATUS:
                # `cli.exit_status` reads the core's ValueError as a user mistake: exit 2.
                raise EngineStartupError(f"engine core {rank} failed to start (its reason "
                                         "is above): ValueError: a setting cannot work")
            if proc.proc.returncode == STARTUP_FAILED_STATUS:
                raise EngineStartupError(f"engine core {rank} failed to start (its reason "
                                         "is above)")
            if self._store is not None:  # the other cores of the lockstep cannot step alone
                from ringserve.engine.core import dp_wave

                dp_wave.announce_fault(self._store, dp_wave.current_epoch(self._store), reason)
            if not self.config.fault_tolerance_config.enable_fault_tolerance:
                raise EngineDeadError(f"{reason} (fault tolerance is off)")
            crash_loop = self.budgets[rank].spend()
            if crash_loop is not None:
                raise EngineDeadError(f"{reason}; not restarted: {crash_loop}")
            logger.error("%s: restarting it", reason)
            greet = None
            if rank in self.topology.remote_engines:
                # The frontends watch this core by its link: the successor greets only once
                # they have certainly called its predecessor lost by its silence (and failed
                # its requests), so a fast restart is never taken for the same process.
                beat = self.topology.heartbeat_s
                greet = time.monotonic() + self.topology.lost_after_s + 3 * beat
            self.cores[rank] = await trio.to_thread.run_sync(self._core, rank, greet)
            self.restarts[rank] += 1

    async def _keep_coordinator(self) -> None:
        while True:
            assert self.coordinator is not None
            await self._wait_exit(self.coordinator)
            if self._closed:
                return
            logger.error("the DP coordinator %s: restarting it",
                         self.coordinator.describe_exit())
            self.coordinator.lifeline.cut()
            self.coordinator = await trio.to_thread.run_sync(self._start_coordinator)

    async def _serve_joins(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Answer headless hosts' `JoinRequest`s with the topology (REP on the rpc port)."""
        ctx: zmq.Context[Any] = zmq.Context.instance()
        sock = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        addr = _tcp(self.cluster.data_parallel_address, self.cluster.data_parallel_rpc_port)
        if self._secure_server is not None:
            self._secure_server(sock)
        try:
            sock.bind(addr)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(f"--data-parallel-rpc-port: cannot bind {addr}: {exc}") from None
        task_status.started()
        decoder = msgspec.msgpack.Decoder(JoinRequest)
        try:
            while True:
                frame = await recv_frame(sock)
                sock.send(msgspec.msgpack.encode(self._join_reply(decoder, frame)))
        finally:
            sock.close(linger=0)

    def _join_reply(self, decoder: msgspec.msgpack.Decoder[JoinRequest],
                    frame: bytes) -> JoinReply:
        try:
            request = decoder.decode(frame)
        except (msgspec.MsgspecError, ValueError, TypeError) as exc:
            return JoinReply(error=f"malformed join request: {exc}")
        size = self.topology.data_parallel_size
        if request.data_parallel_size != size:
            return JoinReply(error=f"--data-parallel-size: the head runs {size}, this host "
                                   f"said {request.data_parallel_size}")
        ranks = range(request.start_rank, request.start_rank + request.count)
        foreign = [r for r in ranks if r not in self.topology.remote_engines]
        if foreign:
            return JoinReply(error=f"engine ranks {foreign} are not the head's remote ranks "
                                   f"{self.topology.remote_engines} (check "
                                   "--data-parallel-start-rank and --data-parallel-size-local)")
        if request.model != self.config.model_config.model:
            logger.warning("a headless host joined with model %r (the head serves %r)",
                           request.model, self.config.model_config.model)
        logger.info("a headless host joined with engine ranks %s", list(ranks))
        return JoinReply(topology=self.topology)

    def stop(self) -> None:
        """Stop the cores and the coordinator (all at once, then wait); idempotent."""
        self._closed = True
        procs: list[ChildProcess] = list(self.cores.values())
        if self.coordinator is not None:
            procs.append(self.coordinator)
        for proc in procs:
            proc.signal_stop()
        for proc in procs:
            proc.terminate()
        self._store = None


def join_head(config: EngineConfig, cluster: ClusterSettings,
              secure_client: Callable[[zmq.Socket[Any]], None] | None) -> ClusterTopology:
    """A headless host asks the head for the topology (blocking, retried until it answers,
    at most `_JOIN_TIMEOUT_S`).

    Raises:
        OSError: the head did not answer in time.
        ValueError: the head refused this host (its reason).
    """
    addr = _tcp(cluster.data_parallel_address, cluster.data_parallel_rpc_port)
    request = JoinRequest(cluster.data_parallel_start_rank, cluster.local_engines(config),
                          config.parallel_config.data_parallel_size,
                          config.model_config.model)
    ctx: zmq.Context[Any] = zmq.Context.instance()
    end = time.monotonic() + _JOIN_TIMEOUT_S
    while time.monotonic() < end:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        if secure_client is not None:
            secure_client(sock)
        sock.connect(addr)
        try:
            sock.send(msgspec.msgpack.encode(request))
            if sock.poll(2000):
                reply = msgspec.msgpack.decode(sock.recv(), type=JoinReply)
                if reply.topology is None:
                    raise ValueError(f"the head at {addr} refused this host: {reply.error}")
                return reply.topology
        finally:
            sock.close(linger=0)
        logger.info("waiting for the head at %s", addr)
    raise OSError(f"the head at {addr} did not answer within {_JOIN_TIMEOUT_S:.0f} s")


def remove_run_dir(path: str | None) -> None:
    """Remove the deployment's ipc directory."""
    if path:
        shutil.rmtree(path, ignore_errors=True)


def new_run_dir() -> str:
    """A private directory for the deployment's ipc sockets (cleaned if a run was killed)."""
    return make_ipc_dir()

