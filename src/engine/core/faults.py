"""The engine core's fault vocabulary, below both the busy loop and its sentinel.

`EngineCoreProc` raises `FaultInstruction` out of its busy loop when an operator's instruction
reaches a healthy core, and `FaultSentinel` (which runs that loop) catches it; `describe` is the
one form in which an error crosses the wire. Kept apart so that the process imports nothing of
the sentinel that supervises it.
"""

from __future__ import annotations

from ringserve.engine.wire import UtilityCall


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
