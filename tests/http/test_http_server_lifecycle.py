"""The server's supervisor in-process, over a fake engine: drain, forced stop, stop during
start-up, engine death; and the picking of the error to report out of an exception group."""

from __future__ import annotations

import os
import signal
from typing import Any

import trio
from starlette.applications import Starlette

from ringserve.engine.errors import EngineDeadError
from ringserve.http.server import hypercorn_config, open_listener, pick_error
from ringserve.http.settings import ServerState, ServeSettings
from ringserve.http.supervisor import Supervisor


class FakeEngine:
    """The part of AsyncLLM the supervisor uses: run(task_status), shutdown(), is_running."""

    def __init__(self, start_delay: float = 0.0) -> None:
        self.start_delay = start_delay
        self.stopped = trio.Event()
        self.shut_down = False
        self.die: EngineDeadError | None = None
        self.die_now = trio.Event()

    @property
    def is_running(self) -> bool:
        return not self.shut_down

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await trio.sleep(self.start_delay)
        task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._die_later)
            await self.stopped.wait()
            nursery.cancel_scope.cancel()
        if self.die is not None:
            raise self.die

    async def _die_later(self) -> None:
        await self.die_now.wait()
        self.die = EngineDeadError("engine core 0 killed by signal SIGKILL")
        self.stopped.set()

    def shutdown(self) -> None:
        self.shut_down = True
        self.stopped.set()


class Outcome:
    """How `Supervisor.run` ended."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None

    def is_set(self) -> bool:
        return self.done.is_set()

    async def wait(self) -> None:
        await self.done.wait()


async def _start(engine: FakeEngine, nursery: trio.Nursery, timeout: float = 30.0,
                 ) -> tuple[Supervisor, ServerState, Outcome]:
    settings = ServeSettings(port=0, shutdown_timeout=timeout)
    state = ServerState()
    config = hypercorn_config(settings, open_listener("127.0.0.1", 0))
    supervisor = Supervisor(engine, settings, state)  # type: ignore[arg-type]
    done = Outcome()

    async def run() -> None:
        try:
            await supervisor.run(Starlette(), config)
        except Exception as exc:
            done.error = exc
        finally:
            done.done.set()

    nursery.start_soon(run)
    return supervisor, state, done


async def _until(predicate: Any) -> None:
    with trio.fail_after(10):
        while not predicate():
            await trio.sleep(0.01)


async def test_sigterm_waits_for_in_flight_requests() -> None:
    engine = FakeEngine()
    async with trio.open_nursery() as nursery:
        _sup, state, done = await _start(engine, nursery)
        await _until(lambda: state.ready)
        state.enter()
        os.kill(os.getpid(), signal.SIGTERM)
        await _until(lambda: state.draining)
        await trio.sleep(0.2)
        assert not done.is_set() and not engine.shut_down  # still draining
        state.leave()
        with trio.fail_after(10):
            await done.wait()
    assert engine.shut_down


async def test_a_second_signal_forces_the_stop() -> None:
    engine = FakeEngine()
    async with trio.open_nursery() as nursery:
        _sup, state, done = await _start(engine, nursery)
        await _until(lambda: state.ready)
        state.enter()
        os.kill(os.getpid(), signal.SIGINT)
        await _until(lambda: state.draining)
        os.kill(os.getpid(), signal.SIGINT)
        with trio.fail_after(10):
            await done.wait()
    assert engine.shut_down and state.in_flight == 1


async def test_the_drain_ends_at_the_shutdown_timeout() -> None:
    engine = FakeEngine()
    async with trio.open_nursery() as nursery:
        _sup, state, done = await _start(engine, nursery, timeout=0.3)
        await _until(lambda: state.ready)
        state.enter()
        os.kill(os.getpid(), signal.SIGTERM)
        with trio.fail_after(10):
            await done.wait()
    assert engine.shut_down


async def test_a_signal_during_start_up_stops_at_once() -> None:
    engine = FakeEngine(start_delay=60)
    async with trio.open_nursery() as nursery:
        supervisor, state, done = await _start(engine, nursery)
        await trio.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)
        with trio.fail_after(10):
            await done.wait()
    assert not state.ready and supervisor.stop_signal == signal.SIGTERM


async def test_engine_death_drains_then_raises_it() -> None:
    engine = FakeEngine()
    async with trio.open_nursery() as nursery:
        _sup, state, done = await _start(engine, nursery)
        await _until(lambda: state.ready)
        state.enter()
        engine.die_now.set()
        await _until(lambda: state.draining)
        await trio.sleep(0.1)
        assert not done.is_set()  # the failed stream may still flush its error
        state.leave()
        with trio.fail_after(10):
            await done.wait()
    # Raised as itself, not inside an exception group.
    assert isinstance(done.error, EngineDeadError) and "SIGKILL" in str(done.error)


def test_pick_error_prefers_the_telling_leaf() -> None:
    dead = EngineDeadError("gone")
    group = BaseExceptionGroup("x", [RuntimeError("bug"), ExceptionGroup("y", [dead])])
    assert pick_error(group) is dead
    port = OSError("cannot listen")
    assert pick_error(BaseExceptionGroup("x", [port])) is port
    bugs = BaseExceptionGroup("x", [RuntimeError("a"), RuntimeError("b")])
    assert pick_error(bugs) is bugs


def test_keep_alive_timeout_reaches_hypercorn() -> None:
    """`--timeout-keep-alive` (vLLM's flag) is hypercorn's keep_alive_timeout."""
    sock = open_listener("127.0.0.1", 0)
    config = hypercorn_config(ServeSettings(port=0, timeout_keep_alive=42.0), sock)
    try:
        assert config.keep_alive_timeout == 42.0
    finally:
        import os

        os.close(int(config.bind[0].removeprefix("fd://")))
