"""Watching an `AsyncMPClient`'s core processes and restarting one that dies
(`CoreWatch`, a base of `AsyncMPClient`).

Each core is watched through a pidfd (its death is seen at once). With fault tolerance on, a
core that dies is restarted on the same sockets: its requests fail at once, it is UNHEALTHY
until the new process's handshake arrives, and the new process takes over the old one's
routing id. With fault tolerance off, when the restart fails, or when the core is
crash-looping, the client is dead. A core stopped on purpose (`retiring`: it left the
deployment by elastic scaling) is no fault.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import trio

from ringserve import envs
from ringserve.config import EngineConfig
from ringserve.engine.errors import RECOVERING_MESSAGE, EngineRecoveringError
from ringserve.engine.frontend.core_sender import CoreSender
from ringserve.engine.frontend.fault_tolerance import EngineFaultState, RestartBudget
from ringserve.engine.frontend.mp_client import CoreProcess
from ringserve.engine.wire import EngineStatus, FaultStatus, HandshakeReply
from ringserve.shm import cleanup_stale

logger = logging.getLogger(__name__)


class CoreWatch:
    """The core-watching half of `AsyncMPClient` (which sets these attributes)."""

    config: EngineConfig
    processes: list[CoreProcess]
    fault_states: list[EngineFaultState]
    restarting: set[int]
    restarts: list[int]
    dead: str | None
    num_engines: int
    input_addr: str
    output_addr: str
    _executor: str
    _sender: CoreSender
    _closed: bool
    _store: Any
    _restart_budgets: list[RestartBudget]
    _calls: dict[int, tuple[trio.Event, list[Any]]]
    _handshakes: dict[int, tuple[trio.Event, list[HandshakeReply]]]
    _watching: tuple[trio.Nursery, Callable[[int, str], None]] | None

    mark_dead: Callable[[str], None]  # AsyncMPClient's

    @property
    def _restarts_cores(self) -> bool:
        """Fault tolerance is on: a core whose process dies is restarted."""
        return self.config.fault_tolerance_config.enable_fault_tolerance

    async def watch_cores(self, on_core_death: Callable[[int, str], None]) -> None:
        """Watch the core processes; return once the engine is dead (marked dead).

        A core process that exits while the client is open is a fault. With fault tolerance
        on, and unless the core had declared itself DEAD first (an `abort`, or no instruction
        within the recovery timeout), the core is restarted: it is marked UNHEALTHY,
        `on_core_death(index, reason)` fails its requests, its pending utility calls fail, a
        new process starts on the same sockets and, after its handshake, the core is HEALTHY
        again. Otherwise, when the restart fails, or when the core already used up its
        restarts (`fault_tolerance.RestartBudget`), the engine is dead.

        Args:
            on_core_death: called at once with the core's index and what happened to it.
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sender.run)  # queued aborts go out once there is room
            self._watching = (nursery, on_core_death)
            for index in range(self.num_engines):
                self.watch_core(index)
        self._watching = None

    def watch_core(self, index: int) -> None:
        """Start watching core `index`'s process (a core added by elastic scaling; the
        others are watched from `watch_cores`' start)."""
        if self._watching is not None:
            nursery, on_core_death = self._watching
            nursery.start_soon(self._watch_core, index, on_core_death, nursery.cancel_scope)

    async def _watch_core(self, index: int, on_core_death: Callable[[int, str], None],
                          scope: trio.CancelScope) -> None:
        while index < len(self.processes):  # else it left (elastic scale-down)
            proc = self.processes[index]
            try:
                fd = os.pidfd_open(proc.pid)
            except ProcessLookupError:
                pass  # it died and was reaped before this task started watching
            else:
                try:
                    await trio.lowlevel.wait_readable(fd)
                finally:
                    os.close(fd)
            # Acted on at once: the status is read without waiting for the reaping thread.
            if proc.retiring:
                return  # stopped on purpose: it left the deployment (elastic scale-down)
            if self._closed:
                scope.cancel()
                return
            reason = f"engine core {index} {proc.describe_exit()}"
            _remove_dead_segments()
            if self.dead is None and self._restarts_cores and not self._declared_dead(index):
                crash_loop = self._restart_budgets[index].spend()
                if crash_loop is None:
                    logger.error("%s: restarting it", reason)
                    fault = f"{reason}; it is being restarted"
                    self._core_lost(index, fault)
                    on_core_death(index, fault)
                    failure = await self._restart_core(index)
                    _remove_dead_segments()  # the old core's workers have exited by now
                    if failure is None:
                        continue
                    reason = f"{reason}; its restart failed: {failure}"
                else:
                    reason = f"{reason}; not restarted: {crash_loop}"
            self.mark_dead(reason)
            on_core_death(index, reason)
            scope.cancel()
            return

    def _declared_dead(self, index: int) -> bool:
        return self.fault_states[index].status == str(EngineStatus.DEAD)

    def _core_lost(self, index: int, fault: str) -> None:
        """Mark a core UNHEALTHY while it restarts and fail its pending utility calls."""
        self.restarting.add(index)
        if self._store is not None:  # the other cores of the lockstep cannot step alone
            from ringserve.engine.core import dp_wave

            dp_wave.announce_fault(self._store, dp_wave.current_epoch(self._store), fault)
        state = self.fault_states[index]
        state.status = str(EngineStatus.UNHEALTHY)
        state.fault_info = fault
        state.ft_error = None
        self._sender.fail(index, EngineRecoveringError(f"{RECOVERING_MESSAGE} ({fault})"))
        for event, results in self._calls.values():
            if not any(engine == index for engine, _failure, _value in results):
                results.append((index, fault, None))
                event.set()

    async def _restart_core(self, index: int) -> str | None:
        """Start a new process for core `index`; None once it is ready, else why not."""
        old = self.processes[index]
        old.lifeline.cut()
        event, replies = trio.Event(), list[HandshakeReply]()
        self._handshakes[index] = (event, replies)
        started = time.monotonic()
        try:
            proc = await trio.to_thread.run_sync(
                lambda: CoreProcess(self.config, index, self.input_addr, self.output_addr,
                                    self._executor))
            self.processes[index] = proc
            with trio.move_on_after(envs.engine_ready_timeout_s()):
                await await_handshake(proc, event)
        except OSError as exc:
            return f"cannot start a process: {exc}"
        finally:
            self._handshakes.pop(index, None)
        if not replies:
            if proc.exited.is_set():
                return f"the new core {proc.describe_exit()} before it was ready"
            proc.terminate()
            return (f"the new core was not ready within {envs.engine_ready_timeout_s():.0f} s "
                    "(RINGSERVE_ENGINE_READY_TIMEOUT_S)")
        reply = replies[0]
        if not reply.ready:
            proc.terminate()
            return reply.error
        self.restarts[index] += 1
        self.restarting.discard(index)
        self.fault_states[index].update(FaultStatus(EngineStatus.HEALTHY))
        logger.warning("engine core %d restarted in %.1f s", index, time.monotonic() - started)
        return None


async def await_handshake(proc: CoreProcess, event: trio.Event) -> None:
    """Return once `event` is set (the core's handshake arrived) or the process has exited."""
    async with trio.open_nursery() as nursery:
        async def exited() -> None:
            await trio.to_thread.run_sync(proc.exited.wait, abandon_on_cancel=True)
            nursery.cancel_scope.cancel()
        nursery.start_soon(exited)
        await event.wait()
        nursery.cancel_scope.cancel()


def _remove_dead_segments() -> None:
    """Unlink the ring segments of processes that died before both ends attached (a core
    or worker killed while starting; attached segments are unlinked already)."""
    removed = cleanup_stale()
    if removed:
        logger.info("removed %d shared-memory segment(s) of dead processes", len(removed))
