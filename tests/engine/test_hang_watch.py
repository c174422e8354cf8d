"""The frontend's watch for hung engine cores (`CoreWatch._watch_silence`) over a fake client:
a core heard from keeps serving; one silent for the hang timeout (--execute-model-timeout-s)
has its requests failed with an engine fault, is UNHEALTHY, has its pending utility calls
answered and is sent the hung notice; heard from again, it is no longer silent (its own
fault report follows). A stall of the frontend's own event loop is not the core's silence.
The live cases: `test_fault_tolerance.py::test_hung_core_fails_its_streams_within_the_timeout`
and `test_dp_expert_parallel.py::test_hung_core_fails_every_stream_within_the_timeout`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import trio

from ringserve import EngineArgs
from ringserve.engine.errors import EngineGenerateError
from ringserve.engine.frontend.core_watch import CoreWatch
from ringserve.engine.frontend.fault_tolerance import EngineFaultState
from ringserve.engine.wire import CORE_HUNG_METHOD

pytestmark = pytest.mark.slow  # the engine config's imports


class _Sender:
    def __init__(self) -> None:
        self.posted: list[tuple[int, Any]] = []

    def post(self, engine: int, message: Any, *, keep: bool = False) -> None:
        assert keep  # the notice is never withdrawn
        self.posted.append((engine, message))


class _Client(CoreWatch):
    """Two cores, no processes: what `_watch_silence` reads and writes."""

    def __init__(self, model_dir: Path) -> None:
        self.config = EngineArgs(model=str(model_dir), device="cpu",
                                 execute_model_timeout_s=0.4).create_engine_config()
        self.num_engines = 2
        self.fault_states = [EngineFaultState(0), EngineFaultState(1)]
        self.restarting, self.hung, self.heard_at = set(), set(), {}
        self.dead, self._closed, self._store = None, False, None
        self._calls = {}
        self._sender = _Sender()  # type: ignore[assignment]
        self.deaths: list[tuple[int, Any]] = []

    def on_core_death(self, index: int, reason: str | BaseException) -> None:
        self.deaths.append((index, reason))


async def test_a_silent_core_is_hung_and_a_beating_one_is_not(tiny_llama_dir: Path) -> None:
    client = _Client(tiny_llama_dir)
    event, results = trio.Event(), list[Any]()
    client._calls[1] = (event, results)  # a utility call both cores have not answered
    async with trio.open_nursery() as nursery:
        for index in (0, 1):
            nursery.start_soon(client._watch_silence, index, client.on_core_death,
                               nursery.cancel_scope)
        with trio.fail_after(30):
            while not client.hung:
                client.heard_from(0)  # core 0 beats; core 1 is silent
                await trio.sleep(0.02)
        assert client.hung == {1}
        (index, error), = client.deaths
        assert index == 1 and isinstance(error, EngineGenerateError)
        assert str(error).startswith("engine fault: engine core 1 sent nothing for")
        assert client.fault_states[1].status == "unhealthy" and client.fault_states[0].healthy
        assert results == [(1, client.fault_states[1].fault_info, None)] and event.is_set()
        (engine, notice), = client._sender.posted  # type: ignore[attr-defined]
        assert engine == 1 and notice.method == CORE_HUNG_METHOD and notice.call_id == 0
        client.heard_from(1)  # it runs again
        assert not client.hung
        nursery.cancel_scope.cancel()


async def test_a_stall_of_the_frontend_is_not_the_cores_silence(tiny_llama_dir: Path) -> None:
    client = _Client(tiny_llama_dir)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client._watch_silence, 0, client.on_core_death,
                           nursery.cancel_scope)
        await trio.sleep(0.05)
        time.sleep(1.0)  # the event loop blocked: the core's beats wait unread
        await trio.sleep(0.15)  # the watchdog's next tick (the beats would be read by now)
        assert not client.hung and not client.deaths
        nursery.cancel_scope.cancel()
