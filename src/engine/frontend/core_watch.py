"""Watching an `AsyncMPClient`'s core processes and restarting one that dies
(`CoreWatch`, a base of `AsyncMPClient`).

Each core is watched through a pidfd (its death is seen at once). With fault tolerance on, a
core that dies is restarted on the same sockets: its requests fail at once, it is UNHEALTHY
until the new process's handshake arrives, and the new process takes over the old one's
routing id. With fault tolerance off, when the restart fails, or when the core is
crash-looping, the client is dead. A core stopped on purpose (`retiring`: it left the
deployment by elastic scaling) is no fault.

With a hang timeout (`ringserve.engine.core.faults.hang_timeout_s`: `--execute-model-timeout-s`,
or a lockstep deployment's) a core that sends nothing for that long (an idle core beats) is
hung: SIGSTOPped, or stuck. Its process is alive, so nothing else would end its streams. Its
requests fail at once with an engine fault, as a faulted core's do; it is UNHEALTHY; its
pending utility calls fail, and new ones are answered for it at once while it is silent; and
it is sent `CORE_HUNG_METHOD`, which it takes as an engine fault once it runs again (its late
outputs are for requests the frontend no longer tracks, and are dropped). It is then
unhealthy by its own report and waits for `retry`. With fault tolerance off the client is dead.
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
from ringserve.engine.core.faults import hang_timeout_s
from ringserve.engine.errors import RECOVERING_MESSAGE, EngineGenerateError, EngineRecoveringError
from ringserve.engine.frontend.core_sender import CoreSender
from ringserve.engine.frontend.fault_tolerance import EngineFaultState, RestartBudget
from ringserve.engine.frontend.mp_client import CoreProcess
from ringserve.engine.wire import (
    CORE_HUNG_METHOD,
    EngineStatus,
    FaultStatus,
    HandshakeReply,
    UtilityCall,
)
from ringserve.shm import cleanup_stale

logger = logging.getLogger(__name__)

# Called with a core's index and what happened to it: a reason (its requests fail with
# EngineDeadError) or the error its requests fail with.
OnCoreDeath = Callable[[int, str | BaseException], None]


class CoreWatch:
    """The core-watching half of `AsyncMPClient` (which sets these attributes)."""

    config: EngineConfig
    processes: list[CoreProcess]
    fault_states: list[EngineFaultState]
    restarting: set[int]
    hung: set[int]  # silent for the hang timeout, not heard from since
    heard_at: dict[int, float]  # when each core was last heard from (time.monotonic)
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
    _watching: tuple[trio.Nursery, OnCoreDeath] | None

    mark_dead: Callable[[str], None]  # AsyncMPClient's

    @property
    def _restarts_cores(self) -> bool:
        """Fault tolerance is on: a core whose process dies is restarted."""
        return self.config.fault_tolerance_config.enable_fault_tolerance

    async def watch_cores(self, on_core_death: OnCoreDeath) -> None:
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
            if hang_timeout_s(self.config) is not None and self.watches_silence(index):
                nursery.start_soon(self._watch_silence, index, on_core_death,
                                   nursery.cancel_scope)

    def watches_silence(self, index: int) -> bool:
        """Whether core `index` is watched for hangs here (a core on another host is watched
        by its link instead)."""
        return True

    def heard_from(self, index: int) -> None:
        """Core `index` sent something: it is not hung (any more)."""
        self.heard_at[index] = time.monotonic()
        self.hung.discard(index)

    async def _watch_silence(self, index: int, on_core_death: OnCoreDeath,
                             scope: trio.CancelScope) -> None:
        """Call core `index` hung once it has sent nothing for the hang timeout (see the
        module docstring); until it leaves the deployment."""
        limit = hang_timeout_s(self.config)
        assert limit is not None  # watch_core checked it
        tick = min(0.5, limit / 4)
        state = self.fault_states[index]
        self.heard_at[index] = time.monotonic()
        while (index < self.num_engines and self.fault_states[index] is state
               and not self._closed and self.dead is None):
            now = time.monotonic()
            silent = now - self.heard_at.get(index, now)
            if index in self.restarting:
                self.heard_at[index] = now  # its successor is watched from its handshake
            elif index not in self.hung and silent > limit:
                self._core_hung(index, f"engine core {index} sent nothing for {silent:.1f} s "
                                f"(hang timeout {limit:g} s): it is hung", on_core_death, scope)
            # A watchdog's tick (a few a second), as for a core on another host: silence is
            # the absence of a wake-up, so there is nothing else to block on.
            await trio.sleep(tick)
            if time.monotonic() - now > 2 * tick:
                # This frontend's own event loop stalled (blocking work on it): the core's
                # beats may be waiting unread in the socket, so its silence counts anew.
                self.heard_at[index] = max(self.heard_at.get(index, 0.0), time.monotonic())

    def _core_hung(self, index: int, fault: str, on_core_death: OnCoreDeath,
                   scope: trio.CancelScope) -> None:
        """Fail a hung core's requests and pending calls, mark it UNHEALTHY and send it the
        hung notice (with fault tolerance off: the client is dead)."""
        logger.error("%s", fault)
        if not self._restarts_cores:
            self.mark_dead(fault)
            on_core_death(index, fault)
            scope.cancel()
            return
        self.hung.add(index)
        self._announce_lockstep_fault(fault)
        state = self.fault_states[index]
        state.status = str(EngineStatus.UNHEALTHY)
        state.fault_info = fault
        state.ft_error = None
        self._fail_calls(index, fault)
        self._sender.post(index, UtilityCall(0, CORE_HUNG_METHOD, [fault]), keep=True)
        on_core_death(index, EngineGenerateError(f"engine fault: {fault}"))

    def _fail_calls(self, index: int, failure: str) -> None:
        """Answer core `index`'s part of every pending utility call with `failure`."""
        for event, results in self._calls.values():
            if not any(engine == index for engine, _failure, _value in results):
                results.append((index, failure, None))
                event.set()

    def _announce_lockstep_fault(self, fault: str) -> None:
        if self._store is not None:  # the other cores of the lockstep cannot step alone
            from ringserve.engine.core import dp_wave

            dp_wave.announce_fault(self._store, dp_wave.current_epoch(self._store), fault)

    async def _watch_core(self, index: int, on_core_death: OnCoreDeath,
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
        self.hung.discard(index)
        self._announce_lockstep_fault(fault)
        state = self.fault_states[index]
        state.status = str(EngineStatus.UNHEALTHY)
        state.fault_info = fault
        state.ft_error = None
        self._sender.fail(index, EngineRecoveringError(f"{RECOVERING_MESSAGE} ({fault})"))
        self._fail_calls(index, fault)

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
