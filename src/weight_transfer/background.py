"""Calls on helper threads: the overlap a transport needs between a client call and its own
work, and the release of objects whose destructor may block.

A ``shm`` round fills the next bucket while the previous ``update_weights`` runs here; a
gloo / nccl trainer builds its process group here while ``init_weight_transfer_engine`` runs
on the caller's thread (every member must join at once).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class BackgroundCall:
    """``fn()`` on a daemon thread, started at construction.

    Args:
        fn: the call.
        name: the thread's name.
        tag: anything the caller wants to remember about the call (the segment it reads).
    """

    def __init__(self, fn: Callable[[], Any], name: str, tag: object = None) -> None:
        self.tag = tag
        self.value: Any = None
        self.error: BaseException | None = None
        self._fn = fn
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.value = self._fn()
        except BaseException as exc:  # handed to whoever joins
            self.error = exc

    def join(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the call (at most `timeout` seconds); its exception, if it raised."""
        self._thread.join(timeout)
        return self.error

    def done(self) -> bool:
        """Whether the call has returned or raised."""
        return not self._thread.is_alive()

    def result(self) -> Any:
        """Wait for the call; its value, or raise its exception."""
        error = self.join()
        if error is not None:
            raise error
        return self.value


def release_in_background(objects: list[Any]) -> None:
    """Drop the last references in `objects` on a daemon thread.

    For a process group with an operation still pending: its destructor waits until the
    operation times out, which must not block the caller. The caller must hold no other
    reference.
    """
    threading.Thread(target=objects.clear, name="weight-transfer-release", daemon=True).start()
