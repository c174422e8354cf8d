"""`ringserve serve` scaled out: N API servers, a DP coordinator, engines on several hosts.

`serve_scaled_out` is what `ringserve serve` runs instead of `server.serve` when
`ClusterSettings.scaled_out` (more than one API server or engine core, engines on other
hosts, or `--headless`). This process becomes the supervisor of the deployment's tree, under one trio
nursery:

* it binds the listening socket first (so "address already in use" is one line before any
  model loads) and every API server inherits it: the kernel hands each new connection to one
  of the processes accepting on it;
* `cluster.EngineFleet` runs this host's engine cores (and, on the head, the coordinator and
  the join service for headless hosts), restarting a core that dies;
* N frontend processes (`frontend_proc`), each a full `server.serve` over an `AsyncLLM`
  attached to every core; one that dies is restarted (`RestartBudget`) without touching the
  cores or its siblings' streams (the cores abort the dead one's requests). Each accepts
  only once every core has greeted it;
* SIGTERM / SIGINT: every frontend drains (`lifeline.STOP_SIGNAL` to each; they stop
  admitting and finish their streams within `--shutdown-timeout`), then the cores stop. A
  second signal kills the frontends at once. Every child holds a lifeline to this process: a
  SIGKILL of the supervisor leaves no orphan, and ignores SIGTERM and SIGINT: a stop of the
  whole process group (or cgroup) is this process's to carry out, in that order.

`/metrics`: the frontends write their families to files in one directory
(`PROMETHEUS_MULTIPROC_DIR`, the run directory's `metrics/`), and any frontend's `/metrics`
reads all of them: request counters and histograms summed over frontends (each request is
counted by the one frontend that served it), engine gauges as most recently set (a core's
scheduler stats reach exactly one frontend per step, so engine counters are not doubled).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from typing import Any

import msgspec
import trio
import zmq

from ringserve.config import EngineConfig
from ringserve.engine.cluster.fleet import (
    ClusterSettings,
    EngineFleet,
    build_topology,
    join_head,
    new_run_dir,
    remove_run_dir,
    tcp_addresses,
)
from ringserve.engine.cluster.wire import ClusterTopology
from ringserve.engine.errors import EngineDeadError, EngineStartupError
from ringserve.engine.frontend.fault_tolerance import RestartBudget
from ringserve.engine.frontend.mp_client import ChildProcess
from ringserve.http.frontend_proc import ENGINE_DEAD, STARTUP_FAILED, FrontendInit
from ringserve.http.server import _clean_stale, configure_logging, hypercorn_config, open_listener
from ringserve.http.settings import ServeSettings
from ringserve.http.supervisor import STOP_SIGNALS

logger = logging.getLogger(__name__)

_FORCE_WAIT_S = 10.0


def serve_scaled_out(config: EngineConfig, settings: ServeSettings,
                     cluster: ClusterSettings, executor: str = "default") -> None:
    """Run the deployment until SIGINT/SIGTERM (returns) or the engine dies (raises).

    Raises:
        ValueError: inconsistent flags, or an unauthenticated link on a non-loopback address.
        OSError: the address cannot be bound, or the head cannot be reached.
        EngineDeadError: an engine core could not be kept running, or the engine died.
    """
    from ringserve.engine.cluster.auth import ClusterAuth, check_bind_policy

    configure_logging()
    cluster.check(config)
    multi_host = (cluster.headless or cluster.local_engines(config)
                  < config.parallel_config.data_parallel_size)
    if multi_host and config.parallel_config.lockstep:
        raise ValueError("--enable-expert-parallel with engines on other hosts is not "
                             "implemented (the lockstep store lives on one host)")
    if cluster.cluster_secret_file:
        os.environ["RINGSERVE_CLUSTER_SECRET_FILE"] = cluster.cluster_secret_file
    auth = ClusterAuth.load(cluster.cluster_secret_file)
    sock = None
    if not cluster.headless:
        sock = open_listener(settings.host, settings.port)
        _check_tls(settings, sock)
    run_dir = new_run_dir()
    try:
        _clean_stale()
        if cluster.headless:
            topology = join_head(config, cluster, auth.secure_client if auth else None)
        else:
            topology = build_topology(config, cluster, run_dir)
            addrs = tcp_addresses(topology)
            rpc = f"tcp://{cluster.data_parallel_address}:{cluster.data_parallel_rpc_port}"
            check_bind_policy([*addrs, rpc] if topology.remote_engines else addrs, auth,
                              cluster.insecure_cluster)
        metrics_dir = os.path.join(run_dir, "metrics")
        os.makedirs(metrics_dir, exist_ok=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # for the frontends
        deployment = Deployment(config, settings, cluster, topology, sock, executor, auth)
        trio.run(deployment.run)
    finally:
        if sock is not None:
            sock.close()
        remove_run_dir(run_dir)


def _check_tls(settings: ServeSettings, sock: socket.socket) -> None:
    """Load the TLS files once here, so a bad one is one line, not N frontends failing."""
    if settings.certfile is None:
        return
    probe = sock.dup()
    config = hypercorn_config(settings, probe)  # detaches the probe into fd://N
    os.close(int(config.bind[0].removeprefix("fd://")))


class Deployment:
    """The supervisor's tree (see the module docstring)."""

    def __init__(self, config: EngineConfig, settings: ServeSettings,
                 cluster: ClusterSettings, topology: ClusterTopology,
                 sock: socket.socket | None, executor: str, auth: Any) -> None:
        self.settings = settings
        self.cluster = cluster
        self.topology = topology
        self.sock = sock
        self.fleet = EngineFleet(config, cluster, topology, executor,
                                 auth.secure_server if auth is not None else None)
        self.auth = auth
        if not cluster.headless:
            self.fleet.serve_lockstep()
        self.config = self.fleet.config
        self.frontends: list[ChildProcess] = []
        self.budgets = [RestartBudget() for _ in topology.frontends]
        self.frontend_restarts = [0] * len(topology.frontends)
        self.stopping = False
        self.engine_error: EngineDeadError | EngineStartupError | None = None
        self._init = msgspec.msgpack.encode(FrontendInit(self.config, settings, topology))

    async def run(self) -> None:
        """Start everything, supervise, stop in order.

        Raises:
            EngineDeadError: the engine died (after the frontends were stopped).
        """
        serves_joins = (self.auth is not None and not self.cluster.headless
                        and bool(self.topology.remote_engines))
        if serves_joins:
            self.auth.start(zmq.Context.instance())  # the join service's context
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_signals, nursery)
                await nursery.start(self._run_fleet, nursery.cancel_scope)
                if self.topology.control_addr and not self.cluster.headless:
                    from ringserve.engine.cluster.elastic_cluster import ScaleService

                    await nursery.start(ScaleService(self.fleet, self._resized).run)
                if not self.cluster.headless:
                    for index in range(len(self.topology.frontends)):
                        self.frontends.append(self._frontend(index))
                        nursery.start_soon(self._keep_frontend, index, nursery.cancel_scope)
                    logger.info("%d API servers on %s:%d, %d engine core(s) here of %d",
                                len(self.frontends), self.settings.host,
                                self.sock.getsockname()[1] if self.sock else 0,
                                len(self.fleet.ranks), self.topology.data_parallel_size)
                else:
                    logger.info("headless: engine cores %s joined the head at %s",
                                self.fleet.ranks, self.cluster.data_parallel_address)
        finally:
            self._kill_frontends()
            await trio.to_thread.run_sync(self.fleet.stop)
            if serves_joins:
                self.auth.stop()
        if self.engine_error is not None:
            raise self.engine_error
        logger.info("stopped")

    def _resized(self, config: EngineConfig, topology: ClusterTopology) -> None:
        """An elastic scale was committed: an API server started from now on expects the
        new number of cores."""
        self.config, self.topology = config, topology
        self._init = msgspec.msgpack.encode(FrontendInit(config, self.settings, topology))

    def _frontend(self, index: int) -> ChildProcess:
        assert self.sock is not None
        fd = self.sock.fileno()
        cmd = [sys.executable, "-m", "ringserve.http.frontend_proc",
               "--client-index", str(index), "--listen-fd", str(fd)]
        return ChildProcess(cmd, self._init, f"frontend{index}", pass_fds=(fd,),
                            new_group=True)

    async def _run_fleet(self, scope: trio.CancelScope, *,
                         task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self.fleet.run(task_status=task_status)
        except* (EngineDeadError, EngineStartupError) as group:  # from the fleet's nursery
            exc = group.exceptions[0]
            assert isinstance(exc, EngineDeadError | EngineStartupError)
            logger.error("%s; stopping", exc)
            self.engine_error = exc
            await self._stop_frontends(scope)

    async def _keep_frontend(self, index: int, scope: trio.CancelScope) -> None:
        while True:
            proc = self.frontends[index]
            await trio.to_thread.run_sync(proc.exited.wait, abandon_on_cancel=True)
            proc.lifeline.cut()
            if self.stopping:
                return
            code = proc.proc.returncode
            if code in (ENGINE_DEAD, STARTUP_FAILED):
                what = "is dead" if code == ENGINE_DEAD else "could not start"
                self.engine_error = (EngineDeadError if code == ENGINE_DEAD
                                     else EngineStartupError)(
                    f"API server {index} reports the engine {what} (its log above says why)")
                await self._stop_frontends(scope)
                return
            crash_loop = self.budgets[index].spend()
            if crash_loop is not None:
                self.engine_error = EngineDeadError(
                    f"API server {index} {proc.describe_exit()}; not restarted: {crash_loop}")
                await self._stop_frontends(scope)
                return
            logger.error("API server %d %s: restarting it", index, proc.describe_exit())
            self.frontends[index] = await trio.to_thread.run_sync(self._frontend, index)
            self.frontend_restarts[index] += 1

    async def _watch_signals(self, nursery: trio.Nursery) -> None:
        scope = nursery.cancel_scope
        with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if not self.stopping:
                    logger.info("%s: draining %d API server(s) (again to force)", name,
                                len(self.frontends))
                    nursery.start_soon(self._stop_frontends, scope)
                else:
                    logger.warning("%s again: stopping now", name)
                    self._kill_frontends()
                    scope.cancel()

    async def _stop_frontends(self, scope: trio.CancelScope) -> None:
        """Stop every frontend (STOP_SIGNAL), wait for them to drain, then end the tree."""
        if self.stopping:
            return
        self.stopping = True
        for proc in self.frontends:
            proc.signal_stop()
        with trio.move_on_after(self.settings.shutdown_timeout + _FORCE_WAIT_S):
            for proc in self.frontends:
                await trio.to_thread.run_sync(proc.exited.wait, abandon_on_cancel=True)
        scope.cancel()

    def _kill_frontends(self) -> None:
        self.stopping = True
        for proc in self.frontends:
            if proc.proc.poll() is None:
                proc.proc.kill()
            proc.lifeline.cut()
