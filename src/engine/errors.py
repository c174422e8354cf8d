"""Errors of the engine package: per-request versus engine-fatal.

`EngineGenerateError` ends one request; `EngineDeadError` means the engine core is gone and
every pending and new request fails with it; `EngineStartupError` carries the reason a core
reported (or the way it died) during its start-up handshake. `EngineRecoveringError` is the
per-request refusal while a core recovers from a fault (HTTP 503; the engine is not dead).
"""

from __future__ import annotations

from ringserve.errors import RingserveError


class EngineGenerateError(RingserveError):
    """One request failed (bad input found late, a worker-side per-request error)."""


# The error a core gives requests that arrive while it recovers from a fault.
RECOVERING_MESSAGE = "the engine is recovering from a fault"


class EngineRecoveringError(EngineGenerateError):
    """A request refused because an engine core is recovering from a fault; HTTP 503."""


class EngineDeadError(RingserveError):
    """The engine core died or was shut down; no request can be served."""


class EngineStartupError(RingserveError):
    """An engine core failed to start; the message is the core's own reason."""


class QueueOverflowError(RingserveError):
    """Admission control: too many requests in flight (`max_num_queued_reqs`); HTTP 503."""


class MaxQueuedTokensError(RingserveError):
    """Admission control: too many prompt tokens waiting for prefill
    (`max_num_queued_tokens`); HTTP 503."""
