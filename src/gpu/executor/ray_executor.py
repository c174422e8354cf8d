"""The Ray executor: one Ray actor per TP rank, possibly on other machines, driven over zmq/TCP.

Ray places and supervises the workers; it is not the data path. `RayExecutor` binds a ROUTER
socket (steps, utility calls, shutdown, to each rank) and a PULL socket (every rank's replies)
on this node's IP as Ray knows it (`ray.util.get_node_ip_address()`: the address the other
nodes reach this one by; 127.0.0.1 only for a private Ray), reserves a placement group of one
bundle per rank (`ray_placement`: a GPU and a tenth of a CPU each on CUDA, the CPU share
otherwise; ``PACK`` unless ``RINGSERVE_RAY_PLACEMENT_STRATEGY`` says otherwise; no room within
`ray_placement.PLACEMENT_TIMEOUT_S` is a `TimeoutError` that says what did not fit), starts
`tensor_parallel_size` actors of `ray_worker.RayWorker`, rank r in bundle r, hands each its
addresses and the `EngineConfig` as msgpack bytes, and starts every actor's long-running `run`
task. Each actor connects back, says hello, builds its `Worker` (TP > 1: torch.distributed at
rank 0's node IP and a port free there; gloo on CPU, NCCL on CUDA) and serves until the
shutdown message. The framing and the message kinds are `ray_worker`'s and `wire.py`'s; no
pickle crosses zmq, and Ray's own call arguments are plain strings, ints, bools and bytes.

Books and faults are `pending.Pending`'s, as in the mp executor: steps complete in submission
order from rank 0's outputs, calls once every rank replied. A monitor thread waits
(`ray.wait`) on the actors' `run` tasks: an actor's death (`ray.kill`, a crashed process, a
lost node) fails every pending step and call at once with `WorkerDiedError`, and
`check_health()` raises from then on. A lost node is the death of the actors it ran (Ray reports
it a few seconds after the node's processes go); a collective that fails in another rank first
(gloo: "connection closed by peer") waits up to `PEER_DEATH_WAIT_S` for that report, so the
fault names the rank that died rather than its peer. Shutdown removes the placement group.

Which Ray: with ``RAY_ADDRESS`` set (``auto`` or ``host:port``; not Ray Client's ``ray://``)
the executor joins that cluster under Ray's usual rules (a token-auth cluster needs
``RAY_AUTH_MODE=token`` and its token in ``RAY_AUTH_TOKEN`` or ``~/.ray/auth_token``) and only
disconnects on shutdown; if this process already called `ray.init`, it uses that session and
leaves it alone; otherwise it starts a private Ray on 127.0.0.1 (`ray_session._loopback_only`; dashboard
off, usage stats off, token auth with a per-process token so nothing is written to ~/.ray)
whose temp dir is ``RINGSERVE_RAY_TMPDIR`` or a fresh directory it removes afterwards, and
stops it when the last executor using it shuts down, putting back the token-auth settings Ray
changed in this process (`RaySession._restore_auth`). Every node must have ringserve
importable by the same Python, and this node's executor ports reachable from the workers'
(docs/ray.md says how to run on a cluster).

Supervision is Ray's: actors die with their owner (this process), and a private Ray's
processes share this process's fate. Known Ray behaviour, not fixed here: after a SIGKILL of
this process, Ray's two node agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) linger
for about a minute before they exit; Ray's signal handler prints ``*** SIGTERM received``
when the engine core is terminated (its own handler still runs and shuts down cleanly); and
the actors' process titles are Ray's (``ray::RayWorker.run``), not ``ringserve::Worker_TP<r>``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any

import msgspec
import zmq

from ringserve.config import EngineConfig
from ringserve.gpu.executor.errors import ExecutorShutdownError, WorkerDiedError, WorkerError
from ringserve.gpu.executor.inbound import DECODE_ERRORS, ResponseHandler
from ringserve.gpu.executor.ray_placement import (
    ACTOR_NUM_CPUS,
    WorkerPlacement,
    placement_strategy,
    worker_bundle,
)
from ringserve.gpu.executor.ray_session import RaySession
from ringserve.gpu.executor.ray_worker import (
    HELLO,
    RayWorker,
    identity,
    send_message,
    split_message,
)
from ringserve.gpu.executor.remote import RemoteWorkersExecutor
from ringserve.gpu.executor.wire import FrameKind, StepError

logger = logging.getLogger(__name__)

ACTOR_START_TIMEOUT_S = 120.0  # actors in reserved bundles wait this long for a process
HELLO_TIMEOUT_S = 60.0  # started actors connect back within this
SHUTDOWN_GRACE_S = 2.0  # after the shutdown message, before ray.kill
# A rank's failed step waits this long for a peer's death to show: Ray reports the actors of a
# lost node some 3 s after its processes went (measured on Ray 2.60).
PEER_DEATH_WAIT_S = 6.0


class RayExecutor(RemoteWorkersExecutor):
    """Runs one Ray actor per TP rank (see the module docstring).

    The constructor returns once every worker has joined the TP group and loaded the model.

    Args:
        config: the engine configuration (`tensor_parallel_size` actors are started).

    Raises:
        ValueError: ``RINGSERVE_RAY_PLACEMENT_STRATEGY`` is not a Ray placement strategy.
        WorkerDiedError: an actor died (or could not be created) during start-up.
        WorkerError: a worker raised during start-up (the message is the worker's).
        TimeoutError: the cluster had no room for the workers, or they did not start or
            connect in time.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._stopping = False
        self._closed = False
        self._placement_strategy = placement_strategy()  # before Ray: a typo fails at once
        self._placement: WorkerPlacement | None = None
        self._actors: list[Any] = []
        self._runs: list[Any] = []
        self.worker_pids: list[int] = []
        self.worker_node_ids: list[str] = []  # each rank's Ray node (hex), in rank order
        self._threads: list[threading.Thread] = []
        self._ctx = zmq.Context()
        self._sched = self._ctx.socket(zmq.ROUTER)
        self._out = self._ctx.socket(zmq.PULL)
        self._session = False
        try:
            RaySession.acquire()
            self._session = True
            self._start_actors()
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles, in rank order (for tests and operators: `ray.kill`)."""
        return list(self._actors)

    # ---- start-up -------------------------------------------------------------------------

    def _start_actors(self) -> None:
        import ray

        host = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        self._sched.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone rank raises
        self._sched.setsockopt(zmq.LINGER, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        sched_addr = f"tcp://{host}:{self._sched.bind_to_random_port(f'tcp://{host}')}"
        out_addr = f"tcp://{host}:{self._out.bind_to_random_port(f'tcp://{host}')}"
        cuda = self.config.device_config.device == "cuda"
        placement = WorkerPlacement.reserve(
            self.world_size, worker_bundle(cuda), self._placement_strategy
        )
        self._placement = placement
        actor_class = ray.remote(RayWorker)
        config_msgpack = msgspec.msgpack.encode(self.config)
        share_cpu = "OMP_NUM_THREADS" not in os.environ
        self._actors = [
            actor_class.options(
                num_cpus=ACTOR_NUM_CPUS, num_gpus=1 if cuda else 0, max_restarts=0,
                scheduling_strategy=placement.scheduling(rank),
            ).remote(config_msgpack, rank, sched_addr, out_addr, share_cpu)
            for rank in range(self.world_size)
        ]
        infos = self._get_startup([a.node_info.remote() for a in self._actors])
        self.worker_pids = [int(info[2]) for info in infos]
        self.worker_node_ids = [str(info[3]) for info in infos]
        init_method = f"tcp://{infos[0][0]}:{infos[0][1]}" if self.world_size > 1 else ""
        self._runs = [actor.run.remote(init_method) for actor in self._actors]
        self._await_hellos()
        for target, name in ((self._read_loop, "out"), (self._monitor_loop, "monitor")):
            thread = threading.Thread(target=target, name=f"ringserve-ray-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _get_startup(self, refs: list[Any]) -> list[Any]:
        """The results of the actors' first calls, start-up failures mapped to executor errors."""
        import ray

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ACTOR_START_TIMEOUT_S)
        if len(ready) < len(refs):
            late = [rank for rank, ref in enumerate(refs) if ref not in ready]
            raise TimeoutError(
                f"Ray actors for ranks {late} did not start in {ACTOR_START_TIMEOUT_S:.0f} s "
                "in their reserved bundles (can the nodes start worker processes?)"
            )
        results = []
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayError as exc:
                raise self._actor_error(rank, exc) from exc
        return results

    def _await_hellos(self) -> None:
        """Wait until every actor's DEALER said hello (so the ROUTER can route to it)."""
        import ray

        waiting = {identity(rank) for rank in range(self.world_size)}
        poller = zmq.Poller()
        poller.register(self._sched, zmq.POLLIN)
        for _ in range(int(HELLO_TIMEOUT_S * 10)):
            if not waiting:
                return
            if poller.poll(100):
                peer, message = self._sched.recv_multipart()
                if message == HELLO:
                    waiting.discard(peer)
                continue
            done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
            for ref in done:
                rank = self._runs.index(ref)
                raise self._run_ended_error(rank, ref)
        if waiting:
            raise TimeoutError(f"Ray actors {sorted(waiting)} did not connect in {HELLO_TIMEOUT_S:.0f} s")

    # ---- replies and deaths ---------------------------------------------------------------

    def _read_loop(self) -> None:
        """Serve the PULL socket until the context is terminated (shutdown).

        A malformed message is logged (rate-limited) and dropped, as on the mp executor's rings
        (`inbound.py` says how a lost answer surfaces).
        """
        handler = ResponseHandler(self._pending, self._step_failed, "the Ray workers")
        try:
            while True:
                try:
                    frames = self._out.recv_multipart(copy=False)
                except zmq.ContextTerminated:
                    return
                try:
                    kind, bufs = split_message(frames)
                    message = handler.decode(kind, bufs)
                except DECODE_ERRORS as exc:
                    handler.drops.drop(exc)
                    continue
                handler.apply(message)
        except Exception as exc:  # a bug here is an engine fault, never a silent hang
            logger.exception("the Ray executor's reply reader failed")
            self._pending.fail(exc)
        finally:
            self._out.close(linger=0)

    def _step_failed(self, error: StepError) -> None:
        logger.error("worker rank %d failed in step %d:\n%s", error.rank, error.step_id, error.traceback)
        died = self._dead_peer(error.rank)
        if died is not None:
            self._pending.fail(died)
            return
        message = f"worker rank {error.rank} failed in step {error.step_id}: {error.error}"
        self._pending.fail(WorkerError(error.rank, message, error.traceback))

    def _dead_peer(self, rank: int) -> Exception | None:
        """Another rank's death, waiting up to `PEER_DEATH_WAIT_S` for Ray to report one.

        A collective failing in one rank is most often the symptom of another rank's death (a
        killed actor, a lost node); the death is then the fault to report. None when every
        other rank is still running (or while shutting down).
        """
        import ray

        others = [ref for other, ref in enumerate(self._runs) if other != rank]
        if not others or self._stopping:
            return None
        done, _ = ray.wait(others, num_returns=1, timeout=PEER_DEATH_WAIT_S)
        if not done or self._stopping:
            return None
        return self._run_ended_error(self._runs.index(done[0]), done[0])

    def _monitor_loop(self) -> None:
        """Wait on every actor's `run` task; one that ends outside shutdown is a fault."""
        import ray

        remaining = list(self._runs)
        while remaining:
            done, remaining = ray.wait(remaining, num_returns=1)
            for ref in done:
                if not self._stopping:
                    error = self._run_ended_error(self._runs.index(ref), ref)
                    self._pending.fail(error)
                    self._notify_failure(error)

    def _run_ended_error(self, rank: int, ref: Any) -> Exception:
        """The fault for rank `rank`'s `run` task having ended (`ref` is done)."""
        import ray

        try:
            ray.get(ref)
        except ray.exceptions.RayError as exc:
            return self._actor_error(rank, exc)
        return WorkerDiedError(rank, 0)  # it served until a shutdown we did not send

    @staticmethod
    def _actor_error(rank: int, exc: BaseException) -> Exception:
        import ray

        if isinstance(exc, ray.exceptions.RayActorError):
            error: Exception = WorkerDiedError(rank, None)
        else:
            error = WorkerError(rank, f"worker rank {rank}: {exc}")
        error.__cause__ = exc
        return error

    # ---- the Executor interface -----------------------------------------------------------

    def _send(self, kind: FrameKind, message: Any) -> None:
        """Send one message to every rank (caller holds `_send_lock`).

        Raises:
            WorkerDiedError: a rank's connection is gone (its actor died).
        """
        bufs = self._encoder.encode(message)
        for rank in range(self.world_size):
            try:
                send_message(self._sched, kind, bufs, prefix=(identity(rank),))
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                raise WorkerDiedError(rank, None) from exc

    # ---- shutdown -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Shutdown message, then `ray.kill` the actors, remove their placement group, close
        the sockets, stop Ray if ours.

        Idempotent. Pending steps and calls fail with `ExecutorShutdownError`.
        """
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        if self._actors:
            self._stop_actors()
        if self._placement is not None:
            self._placement.remove()
        for thread in self._threads:
            if thread.name.endswith("monitor"):
                thread.join(timeout=5.0)
        with self._send_lock:
            self._sched.close(linger=0)
        if not any(t.name.endswith("out") for t in self._threads):
            self._out.close(linger=0)  # no reader thread took it over
        self._ctx.term()  # wakes the reader thread with ContextTerminated; it closes its socket
        for thread in self._threads:
            thread.join(timeout=2.0)
        self._pending.fail(ExecutorShutdownError("the executor was shut down"))
        if self._session:
            self._session = False
            RaySession.release()

    def _stop_actors(self) -> None:
        import ray

        if self._send_lock.acquire(timeout=1.0):
            try:
                for rank in range(self.world_size):
                    # An actor that is gone or not connected raises: ray.kill below stops it.
                    with contextlib.suppress(zmq.ZMQError):
                        send_message(self._sched, FrameKind.SHUTDOWN, [b""], prefix=(identity(rank),),
                                     flags=zmq.NOBLOCK)
            finally:
                self._send_lock.release()
        if self._runs:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=SHUTDOWN_GRACE_S)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already dead: nothing left to stop
                logger.debug("ray.kill: %s", exc)
