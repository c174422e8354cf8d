"""`DPLBAsyncMPClient`: `AsyncMPClient` over N data-parallel cores with least-loaded routing.

Each new request goes to the core with the lowest `4 * waiting + running`, from the scheduler
stats each core publishes with its outputs plus the requests sent to it since (a core
recovering from a fault gets none while another is healthy); aborts go to the owning core,
utility calls to all. The cores publish those two counts even with `--disable-log-stats`, so
routing never goes blind (it would degrade to counting sends: round-robin).

Elastic data parallelism (`ringserve.engine.cluster.elastic_dp`) grows and shrinks the set of cores:
`add_cores` takes started cores (after their handshakes) into routing at once; a scale-down
first stops routing new requests to the leaving cores (`routable`), waits until they have
none, then `remove_cores` forgets them. The leaving cores are always the highest indexes, so
the per-core lists only grow or shrink at their ends.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import trio

from ringserve import envs
from ringserve.config import EngineConfig
from ringserve.engine.errors import EngineRecoveringError, EngineStartupError
from ringserve.engine.frontend.async_client import AsyncMPClient
from ringserve.engine.frontend.core_watch import await_handshake
from ringserve.engine.frontend.fault_tolerance import EngineFaultState, RestartBudget
from ringserve.engine.frontend.mp_client import CoreProcess
from ringserve.engine.wire import EngineCoreOutputs, EngineCoreRequest, HandshakeReply


class DPLBAsyncMPClient(AsyncMPClient):
    """`AsyncMPClient` over `data_parallel_size` cores with least-loaded routing."""

    def __init__(self, config: EngineConfig, executor: str = "default") -> None:
        super().__init__(config, executor)
        # Per core: [waiting, running] from its last published stats.
        self._stats = [[0, 0] for _ in range(self.num_engines)]
        # Requests sent to each core since its last stats (counted as waiting).
        self._sent_since_stats = [0] * self.num_engines
        self._owner: dict[str, int] = {}
        # Cores 0..routable-1 take new requests (fewer than num_engines while a scale-down
        # drains the others).
        self.routable = self.num_engines
        # Started by an elastic prepare, not yet committed (stopped by `shutdown`).
        self.pending: list[CoreProcess] = []

    def choose_engine(self, request: EngineCoreRequest) -> int:
        if request.data_parallel_rank is not None:
            engine = request.data_parallel_rank
            if not 0 <= engine < self.routable:
                raise ValueError(f"data_parallel_rank: got {engine}, allowed: "
                                 f"0..{self.routable - 1}")
        else:
            engine = min(range(self.routable), key=self._load)
        self._owner[request.request_id] = engine
        self._sent_since_stats[engine] += 1
        return engine

    def _load(self, engine: int) -> tuple[bool, int]:
        waiting, running = self._stats[engine]
        # A recovering core refuses requests: route around it while another is healthy.
        recovering = not self.fault_states[engine].healthy
        return recovering, 4 * (waiting + self._sent_since_stats[engine]) + running

    def engine_of(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def request_finished(self, request_id: str) -> None:
        self._owner.pop(request_id, None)

    def record_stats(self, outputs: EngineCoreOutputs) -> None:
        stats = outputs.scheduler_stats
        if stats is not None and 0 <= outputs.engine_index < self.num_engines:
            self._stats[outputs.engine_index] = [stats.num_waiting_reqs, stats.num_running_reqs]
            self._sent_since_stats[outputs.engine_index] = 0
        if outputs.finished_requests:
            for rid in outputs.finished_requests:
                self._owner.pop(rid, None)

    # -- elastic scaling -------------------------------------------------------------------------

    def owned_from(self, first: int) -> int:
        """How many requests cores `first`.. still own."""
        return sum(1 for engine in self._owner.values() if engine >= first)

    async def start_cores(self, config: EngineConfig, indexes: Iterable[int]) -> list[CoreProcess]:
        """Start cores `indexes` on this client's sockets and wait for their handshakes; they
        are not routed to (`add_cores` does that). They are `pending` until then.

        Raises:
            EngineStartupError: a core could not start, exited, reported an error or was not
                ready in time; every core this call started is stopped.
        """
        waiters = {i: (trio.Event(), list[HandshakeReply]()) for i in indexes}
        self._handshakes.update(waiters)
        started: list[CoreProcess] = []
        try:
            for index in waiters:
                proc = await trio.to_thread.run_sync(
                    CoreProcess, config, index, self.input_addr, self.output_addr,
                    self._executor)
                started.append(proc)
                self.pending.append(proc)
            with trio.move_on_after(envs.engine_ready_timeout_s()):
                for proc in started:
                    await _ready(proc, *waiters[proc.engine_index])
            for proc in started:
                replies = waiters[proc.engine_index][1]
                if not replies:
                    raise EngineStartupError(
                        f"engine core {proc.engine_index} was not ready within "
                        f"{envs.engine_ready_timeout_s():.0f} s (RINGSERVE_ENGINE_READY_TIMEOUT_S)")
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await self.stop_pending(started)
            if isinstance(exc, OSError):
                raise EngineStartupError(f"cannot start an engine core: {exc}") from exc
            raise
        finally:
            for index in waiters:
                self._handshakes.pop(index, None)
        return started

    async def stop_pending(self, processes: list[CoreProcess]) -> None:
        """Stop these cores (prepared, or removed by `remove_cores`) off the event loop."""
        await stop_cores(processes)
        for proc in processes:
            if proc in self.pending:
                self.pending.remove(proc)

    def add_cores(self, processes: list[CoreProcess]) -> None:
        """Route to these ready cores (indexes num_engines.., in order) from now on."""
        for proc in processes:
            assert proc.engine_index == self.num_engines, "cores are added in index order"
            self.processes.append(proc)
            self._grow()

    def _grow(self) -> None:
        """One more core (index num_engines), routed to and watched from now on."""
        index = self.num_engines
        self.fault_states.append(EngineFaultState(index))
        self._restart_budgets.append(RestartBudget())
        self.restarts.append(0)
        self._stats.append([0, 0])
        self._sent_since_stats.append(0)
        self.num_engines += 1
        self._sender.resize(self.num_engines, EngineRecoveringError("unreachable"))
        self.routable = self.num_engines
        self.watch_core(index)

    def remove_cores(self, count: int) -> list[CoreProcess]:
        """Forget cores `count`.. (drained: they own no request); returns their processes,
        marked retiring (their exit is no fault), for the caller to stop."""
        gone = self.processes[count:]
        for proc in gone:
            proc.retiring = True
        error = EngineRecoveringError(f"engine cores {count}..{self.num_engines - 1} left the "
                                      "deployment (elastic scale-down)")
        for event, results in self._calls.values():
            answered = {engine for engine, _failure, _value in results}
            missing = [i for i in range(count, self.num_engines) if i not in answered]
            results.extend((i, str(error), None) for i in missing)
            if missing:
                event.set()
        for rid in [rid for rid, engine in self._owner.items() if engine >= count]:
            del self._owner[rid]
        for per_core in self._per_core():
            del per_core[count:]
        self._sender.resize(count, error)
        self.restarting -= set(range(count, self.num_engines))
        self.hung -= set(range(count, self.num_engines))
        self.num_engines = count
        self.routable = min(self.routable, count)
        return gone

    def _per_core(self) -> list[list[Any]]:
        """The lists indexed by core (shrunk at their ends by a scale-down)."""
        return [self.processes, self.fault_states, self._restart_budgets, self.restarts,
                self._stats, self._sent_since_stats]

    def shutdown(self) -> None:
        for proc in self.pending:
            proc.signal_stop()
        super().shutdown()
        for proc in self.pending:
            proc.terminate()
        self.pending = []


async def stop_cores(processes: list[CoreProcess]) -> None:
    """Stop cores on purpose (all signalled at once, then waited for, off the event loop);
    marked retiring, their exit is no fault."""
    for proc in processes:
        proc.retiring = True
        proc.signal_stop()
    for proc in processes:
        await trio.to_thread.run_sync(proc.terminate)


async def _ready(proc: CoreProcess, event: trio.Event, replies: list[HandshakeReply]) -> None:
    """Wait for `proc`'s handshake.

    Raises:
        EngineStartupError: it exited first, or its handshake reports an error.
    """
    await await_handshake(proc, event)
    if not replies:
        raise EngineStartupError(f"engine core {proc.engine_index} {proc.describe_exit()} "
                                 "before it was ready (its stderr above says why)")
    if not replies[0].ready:
        raise EngineStartupError(f"engine core {proc.engine_index} failed to start: "
                                 f"{replies[0].error}")
