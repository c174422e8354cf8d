"""The errors of `ringserve.weight_transfer` (bad input is a plain ValueError)."""

from __future__ import annotations

from typing import Any


class WeightTransportError(RuntimeError):
    """Moving a bucket failed: the trainer (or a worker) died, a collective timed out, the
    channel is closed or broken. The receiving side must be initialized again
    (`init_weight_transfer_engine`) before the next bucket."""


class WeightSyncError(RuntimeError):
    """The engine's HTTP server answered a weight-sync call with a non-2xx status.

    Attributes:
        status: the HTTP status code (0 when no answer came: connection refused, timeout).
        body: the decoded JSON body (or the raw text when it is not JSON).
        message: the server's error message (``{"error": {"message": ...}}``, ``detail`` or
            ``message``), or the body itself.
    """

    def __init__(self, status: int, body: Any, message: str | None = None) -> None:
        self.status = status
        self.body = body
        self.message = message if message is not None else _message_of(body)
        super().__init__(f"HTTP {status}: {self.message}" if status else self.message)


def _message_of(body: Any) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if isinstance(body.get(key), str):
                return str(body[key])
    return body if isinstance(body, str) else repr(body)
