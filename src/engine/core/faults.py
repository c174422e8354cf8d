"""The engine core's fault vocabulary, below both the busy loop and its sentinel.

`EngineCoreProc` raises `FaultInstruction` out of its busy loop when an operator's instruction
reaches a healthy core, and `FaultSentinel` (which runs that loop) catches it; `describe` is the
one form in which an error crosses the wire. Kept apart so that the process imports nothing of
the sentinel that supervises it.

A hung core (stopped by SIGSTOP, or stuck so that not even its output thread runs) is found by
its frontends: with a hang timeout (`hang_timeout_s`) a core's output thread sends an empty
batch on every idle link each `heartbeat_s`, and a frontend that hears nothing from a core for
the timeout fails that core's requests, reports it UNHEALTHY and sends it `CORE_HUNG_METHOD`
(`ringserve.engine.frontend.core_watch`). The core raises `DeclaredHung` when it reads that
notice: an engine fault like any other (its requests, already failed at the frontend, end here
too and free their blocks; it then waits for `retry`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ringserve.engine.wire import UtilityCall

if TYPE_CHECKING:
    from ringserve.config import EngineConfig

# The lockstep timeout when --execute-model-timeout-s is unset (`dp_wave.lockstep_timeout`).
LOCKSTEP_DEFAULT_TIMEOUT_S = 60.0


class FaultInstruction(Exception):
    """Raised out of the busy loop when a fault instruction reaches a healthy core.

    Args:
        call: the utility call that carried it.
    """

    def __init__(self, call: UtilityCall) -> None:
        super().__init__(call.method)
        self.call = call


def describe(exc: BaseException) -> str:
    """`Type: message`, the form errors cross the wire in."""
    return f"{type(exc).__name__}: {exc}"


class DeclaredHung(Exception):
    """The frontend declared this core hung (it sent nothing for the hang timeout): raised
    out of the busy loop when the core reads that notice, an engine fault."""


def hang_timeout_s(config: EngineConfig) -> float | None:
    """How long a core may send nothing before its frontends call it hung: the
    `--execute-model-timeout-s`, or on a lockstep deployment the lockstep timeout (its peers
    fault after that long anyway). None: hangs are not detected (as in vLLM)."""
    timeout = config.fault_tolerance_config.execute_model_timeout_s
    if config.parallel_config.lockstep:
        return timeout or LOCKSTEP_DEFAULT_TIMEOUT_S
    return timeout


def heartbeat_s(config: EngineConfig) -> float | None:
    """How often an idle core proves it is alive to its frontends (None: no hang timeout)."""
    timeout = hang_timeout_s(config)
    return None if timeout is None else min(0.5, timeout / 4)
