"""The frontend's view of its engine cores' fault-tolerance state.

Each core publishes a `FaultStatus` (in `EngineCoreOutputs.fault_status`) when its state
changes (`sentinel.py`); `AsyncMPClient` keeps one `EngineFaultState` per core from those
messages and from process deaths, and `AsyncLLM.fault_status()` reports them as a
`FaultStatusReport`, the body of `GET /fault_tolerance/status` (vLLM's shape). A
`RestartBudget` per core tells a crash-looping core (not restarted again) from one that died
once.
"""

from __future__ import annotations

import time
from collections import deque

import msgspec

from ringserve import envs
from ringserve.engine.wire import FAULT_INSTRUCTIONS, EngineStatus, FaultStatus

__all__ = ["FAULT_INSTRUCTIONS", "EngineFaultState", "FaultStatusReport", "RestartBudget",
           "check_instruction"]

SCHEMA_VERSION = 1


class EngineFaultState(msgspec.Struct):
    """One core's state as the frontend knows it.

    Attributes:
        id: the core's data-parallel rank.
        status: "healthy", "unhealthy" or "dead".
        fault_info: the fault (the error, described) while not healthy.
        last_ft_request_id: the last fault instruction the core acted on.
        ft_error: why the last instruction or recovery failed, if it did.
    """

    id: int
    status: str = str(EngineStatus.HEALTHY)
    fault_info: str | None = None
    last_ft_request_id: str | None = None
    ft_error: str | None = None

    @property
    def healthy(self) -> bool:
        """True while the core serves requests."""
        return self.status == str(EngineStatus.HEALTHY)

    def update(self, status: FaultStatus) -> None:
        """Take a core's published status."""
        self.status = str(status.status)
        self.fault_info = status.fault_info
        if status.last_ft_request_id is not None:
            self.last_ft_request_id = status.last_ft_request_id
        self.ft_error = status.ft_error

    def mark_dead(self, reason: str) -> None:
        """The core is gone (its process exited, or the client shut down)."""
        if self.status != str(EngineStatus.DEAD):
            self.status = str(EngineStatus.DEAD)
            self.fault_info = self.fault_info or reason


class FaultStatusReport(msgspec.Struct):
    """`GET /fault_tolerance/status`: every core's state."""

    schema_version: int
    total_engines: int
    engines: list[EngineFaultState]

    @classmethod
    def of(cls, states: list[EngineFaultState]) -> FaultStatusReport:
        """A snapshot (copies) of `states`."""
        copies = [msgspec.structs.replace(state) for state in states]
        return cls(SCHEMA_VERSION, len(copies), copies)


def check_instruction(instruction: str, params: dict[str, object] | None) -> None:
    """Validate a fault instruction and its parameters.

    Raises:
        ValueError: an unknown instruction, or parameters (neither instruction takes any).
    """
    if instruction not in FAULT_INSTRUCTIONS:
        raise ValueError(f"instruction: got {instruction!r}, allowed: "
                         f"{', '.join(FAULT_INSTRUCTIONS)}")
    if params:
        raise ValueError(f"params: {instruction!r} takes no parameters, got "
                         f"{sorted(params)}; send {{}}")


class RestartBudget:
    """How many times one core may be restarted: `RINGSERVE_CORE_RESTART_LIMIT` restarts
    within any `RINGSERVE_CORE_RESTART_WINDOW_S` seconds.

    Both are read at construction, so that a bad value fails the start, not the first restart.
    """

    def __init__(self) -> None:
        self.limit = envs.core_restart_limit()
        self.window = envs.core_restart_window_s()
        self._times: deque[float] = deque()  # monotonic seconds of the restarts in the window

    def spend(self) -> str | None:
        """Count one more restart and return None; or, when the budget is spent (the core is
        crash-looping), count nothing and return why it must not be restarted."""
        now = time.monotonic()
        times = self._times
        while times and now - times[0] > self.window:
            times.popleft()
        if len(times) >= self.limit:
            return (f"it was restarted {len(times)} time(s) within {self.window:g} s already "
                    "(RINGSERVE_CORE_RESTART_LIMIT, RINGSERVE_CORE_RESTART_WINDOW_S)")
        times.append(now)
        return None
