"""Sleep and wake-up of a lockstep deployment reach every core together (all or none), and a
core inside a wave applies a sleep only when the wave ends: `lockstep_sleep.call_together`
over a fake utility channel, `LockstepProcMixin.run_lockstep` over fake waves and core. The
live case (DP=2 + EP, level 2 while a core serves) is
`test_dp_expert_parallel.py::test_sleep_level_2_is_all_cores_or_none`."""

from __future__ import annotations

import queue
from typing import Any

import pytest
import trio

from ringserve.engine.core.lockstep_proc import LockstepProcMixin
from ringserve.engine.frontend.lockstep_sleep import call_together
from ringserve.engine.wire import EngineCoreOutputs, UtilityCall


class _Cores:
    """Two cores' utility channel: records each call; `in_flight` per core."""

    def __init__(self, in_flight: list[int]) -> None:
        self.in_flight = in_flight
        self.calls: list[tuple[Any, ...]] = []

    async def __call__(self, method: str, *args: Any) -> list[Any]:
        self.calls.append((method, *args))
        await trio.lowlevel.checkpoint()
        if method == "hold_new_requests":
            return list(self.in_flight)
        return [None] * len(self.in_flight)


async def test_sleep_with_requests_in_flight_on_one_core_sleeps_none() -> None:
    cores = _Cores([0, 3])
    with pytest.raises(ValueError, match="3 requests are in flight"):
        await call_together(cores, "sleep", 2)
    assert cores.calls == [("hold_new_requests",), ("release_new_requests",)]


async def test_sleep_and_wake_up_reach_every_core_between_hold_and_release() -> None:
    cores = _Cores([0, 0])
    assert await call_together(cores, "sleep", 2) == [None, None]
    assert await call_together(cores, "wake_up") == [None, None]
    assert cores.calls == [("hold_new_requests",), ("sleep", 2), ("release_new_requests",),
                           ("hold_new_requests",), ("wake_up",), ("release_new_requests",)]


async def test_a_cancelled_sleep_still_releases_the_holds() -> None:
    cores = _Cores([0, 0])
    with trio.CancelScope() as scope:
        scope.cancel()
        await call_together(cores, "sleep", 1)
    assert cores.calls[-1] == ("release_new_requests",)


class _Stop(BaseException):
    """Ends the fake busy loop."""


class _Waves:
    """A wave of three steps: consensus says 'work' twice, then the wave ends."""

    def __init__(self) -> None:
        self.running = False
        self.consensus = [True, True, False]

    def wants_to_run(self) -> bool:
        return self.running

    def enter(self, has_work: bool) -> bool:
        self.running = self.running or has_work
        return self.running

    def any_work(self, has_work: bool) -> bool:
        go = self.consensus.pop(0)
        self.running = go
        return go


class _Core:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def has_work(self) -> bool:
        return True

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        self.log.append("step")
        return {}, False

    def dummy_pass(self) -> None:
        self.log.append("dummy")


class _Proc(LockstepProcMixin):
    """The busy loop's inputs: a sleep that arrives after the wave's first step."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.engine_index = 0
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.waves = _Waves()  # type: ignore[assignment]
        self._at_wave_end = []
        self.log: list[str] = []
        self.sent: list[Any] = []
        self.drains = 0
        self.fail_at = fail_at

    def _drain_inputs(self, block: bool) -> None:
        self.drains += 1
        if self.drains == 2:
            call = UtilityCall(7, "sleep", [2])
            if not self.defer_to_wave_end(call):
                self._call_utility(None, call)
        if self.drains == self.fail_at:
            raise RuntimeError("the expert-parallel group failed")
        if self.drains > 3:
            raise _Stop

    def _call_utility(self, core: Any, call: UtilityCall) -> None:
        self.log.append(call.method)

    def send_outputs(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        pass

    def send(self, client: int, message: Any) -> None:
        self.sent.append(message)


def test_a_sleep_inside_a_wave_waits_for_its_end() -> None:
    proc = _Proc()
    core = _Core(proc.log)
    with pytest.raises(_Stop):
        proc.run_lockstep(core, proc.waves)  # type: ignore[arg-type]
    # Kept through the wave's second step, applied once the consensus ended the wave.
    assert proc.log == ["step", "dummy", "step", "dummy", "sleep"]


def test_a_fault_answers_the_sleep_kept_for_the_waves_end() -> None:
    proc = _Proc(fail_at=3)
    with pytest.raises(RuntimeError):
        proc.run_lockstep(_Core(proc.log), proc.waves)  # type: ignore[arg-type]
    assert "sleep" not in proc.log
    (reply,) = proc.sent
    assert reply.utility_output.call_id == 7
    assert "the expert-parallel group failed" in reply.utility_output.failure_message
