"""The root of `ringserve serve`'s task tree: readiness, signals, draining and shutdown.

`Supervisor.run` opens the one root nursery and starts, in order: the signal watcher (SIGINT,
SIGTERM), hypercorn on the already-bound socket, and the engine (`AsyncLLM.run`, whose own
nursery supervises the core processes). When the engine reports ready, `ServerState.ready`
turns true and `/health` answers 200. The first signal starts a graceful stop:

1. `ServerState.draining` turns true: the app answers new requests and `/health` with 503;
2. wait until `ServerState.in_flight` is 0, at most `shutdown_timeout` seconds;
3. hypercorn's shutdown trigger fires (it stops accepting and closes idle connections within
   its graceful timeout) and `engine.shutdown()` stops the cores (a stream still running
   after the timeout ends with an error chunk);
4. both tasks return, the nursery closes, `run` returns: exit status 0.

A second signal skips what is left of the wait and cancels the tree. A signal that arrives
while the engine is still starting cancels the tree at once (there is nothing to drain).

A stop of the whole process group (a terminal's Ctrl-C, `kill 0`, systemd, container runtimes)
reaches the engine cores and their workers too: they ignore SIGTERM and SIGINT, and `shutdown`
stops them with the parent's own signal (`ringserve.lifeline.STOP_SIGNAL`) once the drain is
over. An API server of a scaled-out deployment listens for that signal alone (its supervisor
drains it); it ignores SIGTERM and SIGINT likewise.

An engine core that reports a fault but may recover (UNHEALTHY: fault tolerance is on and it
waits for a `retry`/`abort` instruction, `ringserve.http.fault_tolerance`) does not stop the
server: `/health` and new `/v1` requests answer 503 until it is healthy again. Neither does
a core process that dies (SIGKILL, a crash) while fault tolerance is on: `AsyncMPClient`
fails its requests and restarts it (503 meanwhile). Only a dead engine (`abort`, no
instruction within the recovery timeout, a core that cannot be restarted, or any core death
or fault with `--no-enable-fault-tolerance`) does, as follows.

An engine that dies while serving (`EngineDeadError` out of `AsyncLLM.run`) has already failed
every pending request; the server stops admitting, gives those streams a few seconds to send
their error events, stops hypercorn, and `run` raises the `EngineDeadError`. Any other failure
(the engine's start-up, hypercorn) cancels the tree and leaves `run` in an exception group.
"""

from __future__ import annotations

import logging
import signal
import time
from functools import partial
from typing import Any

import hypercorn.trio
import trio

from ringserve.engine.errors import EngineDeadError
from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.http.settings import ServerState, ServeSettings

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# After an engine death, streams only need to flush their error events.
_DEAD_DRAIN_S = 5.0


class Supervisor:
    """Runs hypercorn and the engine under one nursery and stops them in order.

    Args:
        engine: the engine (not started yet: `run` starts it).
        settings: the server's settings (shutdown timeout, address for the log line).
        state: the state shared with the app (readiness, draining, in-flight count).
        engine_first: start the engine before hypercorn accepts (a frontend of a scaled-out
            deployment: its siblings take the connections until it is ready).
        stop_signals: the signals that stop the server (a frontend of a scaled-out
            deployment: its supervisor's `STOP_SIGNAL`).
    """

    def __init__(self, engine: AsyncLLM, settings: ServeSettings, state: ServerState, *,
                 engine_first: bool = False,
                 stop_signals: tuple[int, ...] = STOP_SIGNALS) -> None:
        self.engine = engine
        self.stop_signals = stop_signals
        self.engine_first = engine_first
        self.settings = settings
        self.state = state
        self.stop_signal: int | None = None
        self.engine_error: EngineDeadError | None = None
        self._drain_timeout = settings.shutdown_timeout
        self._stop_requested = trio.Event()
        self._http_stop = trio.Event()
        self._root: trio.CancelScope | None = None
        self._drain_scope: trio.CancelScope | None = None

    async def run(self, app: Any, config: Any) -> None:
        """Serve until a signal stops the server (returns) or the engine or server fails.

        Args:
            app: the ASGI application.
            config: the hypercorn `Config`, bound to the pre-opened socket.

        Raises:
            EngineDeadError: the engine died while serving (after the short drain).
            BaseExceptionGroup: what made hypercorn or the engine's start-up fail.
        """
        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            self._root = nursery.cancel_scope
            background_scope: trio.CancelScope = await nursery.start(self._hold_background)
            signal_scope: trio.CancelScope = await nursery.start(self._watch_signals)
            serve = partial(hypercorn.trio.serve, app, config,
                            shutdown_trigger=self._http_stop.wait)
            if self.engine_first:
                await nursery.start(self._run_engine)
            binds: list[str] = await nursery.start(serve)
            if not self.engine_first:
                await nursery.start(self._run_engine)
            self.state.ready = True
            logger.info("serving %s at %s (ready in %.1f s)", self.settings.served_model_name,
                        ", ".join(binds), time.monotonic() - started)
            await self._stop_requested.wait()
            await self._drain()
            background_scope.cancel()  # what the drain did not see finish
            self._http_stop.set()
            self.engine.shutdown()
            signal_scope.cancel()
        if self.engine_error is not None:
            raise self.engine_error
        logger.info("stopped")

    def request_stop(self, signum: int) -> None:
        """Begin a graceful stop; a second call forces it (no more waiting for requests).

        Args:
            signum: the signal that asked for it (logged, and kept in `stop_signal`).
        """
        name = signal.Signals(signum).name
        if self.stop_signal is None:
            self.stop_signal = signum
            self.state.draining = True
            if not self.state.ready:
                logger.info("%s while the engine starts: stopping", name)
                self._cancel_all()
                return
            logger.info("%s: draining %d request(s), at most %g s (again to force)",
                        name, self.state.in_flight, self.settings.shutdown_timeout)
            self._stop_requested.set()
            return
        logger.warning("%s again: stopping now", name)
        if self._drain_scope is not None:
            self._drain_scope.cancel()
        else:
            self._cancel_all()

    async def _run_engine(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """`engine.run`; a death after start-up stops the server the orderly way.

        The engine has already failed every pending request with EngineDeadError, so their
        streams end with an error event: rather than cancel the tree (and cut them off), stop
        admitting, let them flush (the drain, at most `_DEAD_DRAIN_S`), then stop hypercorn;
        `run` raises the error once the nursery has closed.
        """
        try:
            await self.engine.run(task_status=task_status)
        except EngineDeadError as exc:
            if not self.state.ready:
                raise  # died while starting: nothing to flush
            logger.warning("the engine died: %d stream(s) get its error, then the server stops",
                           self.state.in_flight)
            self.engine_error = exc
            self.state.draining = True
            self._drain_timeout = min(self._drain_timeout, _DEAD_DRAIN_S)
            self._stop_requested.set()

    async def _hold_background(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The nursery of work that outlives its HTTP request (`ServerState.background`);
        background requests count as in flight, so the drain waits for them."""
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                self.state.background = nursery
                task_status.started(scope)
                await trio.sleep_forever()
        self.state.background = None

    def _cancel_all(self) -> None:
        if self._root is not None:
            self._root.cancel()

    async def _watch_signals(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope, trio.open_signal_receiver(*self.stop_signals) as signals:
            task_status.started(scope)
            async for signum in signals:
                self.request_stop(signum)

    async def _drain(self) -> None:
        """Wait until no request is in flight, at most `shutdown_timeout` seconds."""
        state = self.state
        with trio.move_on_after(self._drain_timeout) as scope:
            self._drain_scope = scope
            while state.in_flight > 0:
                # `idle` is replaced whenever a request enters: wait on the current one.
                await state.idle.wait()
        self._drain_scope = None
        if state.in_flight > 0:
            logger.warning("%d request(s) still in flight after the drain: ending them",
                           state.in_flight)
