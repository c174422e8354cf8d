"""Pause / resume and sleep / wake-up of the engine core: utility methods of `EngineCore`
(a mixin; its state lives there).

While paused (`keep` holds the requests in place, `abort` ends them, `wait` lets them finish
and admits nothing new) or asleep (level 1 frees the KV cache, level 2 the weights too), new
requests are held and queued on `resume()` / `wake_up()`. A `keep` or `abort` pause is also
announced early by the core process's input thread (`hold_for_pause`), so the steps the
workers have not finished are skipped rather than waited for
(`ringserve.gpu.executor.step_hold`); `settle_hold` books them before the pause applies.

A lockstep deployment (DP + expert parallelism) sleeps and wakes every core together
(`ringserve.engine.frontend.lockstep_sleep`): `hold_new_requests` holds new requests on each
core while that is agreed, `release_new_requests` lets them in again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from ringserve import envs
from ringserve.engine.sched.scheduler import Scheduler
from ringserve.engine.wire import EngineCoreOutputs, EngineCoreRequest, FinishReason

if TYPE_CHECKING:
    import threading

    from ringserve.gpu.executor.base import Executor

PauseMode = Literal["keep", "abort", "wait"]


class PauseSleepMixin:
    """`pause` (and its early hold), `resume`, `is_paused`, `sleep`, `wake_up` and
    `is_sleeping` for `EngineCore`."""

    scheduler: Scheduler
    pause_mode: PauseMode | None
    sleep_level: int
    step_timeout: float | None
    _held: list[EngineCoreRequest]  # requests that arrived while paused / asleep
    # New requests are held while the cores of a lockstep deployment agree to sleep / wake.
    _holding_new: bool = False
    executor: Executor
    _hold: bool  # a keep / abort pause is on its way from the input thread
    _hold_lock: threading.Lock
    # EngineCore's:
    drain: Callable[[], dict[int, EngineCoreOutputs]]
    _add_to_scheduler: Callable[[EngineCoreRequest], None]
    _worker_call: Callable[..., list[Any]]
    served_weights_path: Callable[[], str | None]

    def pause(self, mode: str = "keep") -> None:
        """Stop scheduling: `keep` holds requests, `abort` aborts them, `wait` drains them."""
        if mode not in ("keep", "abort", "wait"):
            raise ValueError(f"pause mode: got {mode!r}, allowed: keep, abort, wait")
        if mode == "abort":
            # Their clients did not ask for it: each gets a final output (finish reason
            # abort), sent with the next step's outputs.
            self.scheduler.finish_requests(list(self.scheduler.requests), FinishReason.ABORT,
                                           notify=True)
            held, self._held = self._held, []
            for request in held:
                self.scheduler.reject_request(request, None)
        self.pause_mode = mode  # type: ignore[assignment]

    def hold_for_pause(self) -> None:
        """A pause (keep or abort) has arrived and waits in the input queue: from now on
        schedule nothing, and have the workers skip the steps they have not started.
        Called from the core process's input thread; a no-op where steps cannot be skipped."""
        with self._hold_lock:
            if not self._hold and self.executor.hold_steps(True):
                self._hold = True

    def settle_hold(self) -> dict[int, EngineCoreOutputs]:
        """Before the pause that raised the hold is applied: wait for the steps in flight
        (run or skipped) and book them, then let the workers run steps again. Returns the
        outputs of the steps that ran (empty when no hold was up)."""
        if not self._hold:
            return {}
        try:
            return self.drain()
        finally:
            self._release_hold()

    def _release_hold(self) -> None:
        with self._hold_lock:
            if self._hold:
                self._hold = False
                self.executor.hold_steps(False)

    def resume(self) -> None:
        """Undo `pause`; requests that arrived meanwhile are queued now (unless asleep)."""
        self.pause_mode = None
        self._release_held()

    def holds_new_requests(self) -> bool:
        """Paused, asleep, or holding for a lockstep sleep / wake-up: new requests wait."""
        return self.pause_mode is not None or bool(self.sleep_level) or self._holding_new

    def hold_new_requests(self) -> int:
        """Hold new requests until `release_new_requests` (the requests in flight go on);
        returns how many are in flight. The first step of a lockstep deployment's sleep or
        wake-up: no core can take a request between the check and the sleep, and no core
        starts a wave while another is still loading its weights."""
        self._holding_new = True
        return self.scheduler.get_num_unfinished_requests()

    def release_new_requests(self) -> None:
        """Undo `hold_new_requests`: held requests are queued now (unless paused / asleep)."""
        self._holding_new = False
        self._release_held()

    def _release_held(self) -> None:
        if self.holds_new_requests():
            return
        held, self._held = self._held, []
        for request in held:
            self._add_to_scheduler(request)

    def sleep(self, level: int = 1) -> None:
        """Free device memory: level 1 the KV cache, level 2 also the weights.

        Raises:
            ValueError: requests are in flight (abort them, or pause with mode "wait" and
                let them finish), or a level other than 1 or 2.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level: got {level!r}, allowed: 1 (KV cache) or 2 (+ weights)")
        busy = self.scheduler.get_num_unfinished_requests()
        if busy:
            raise ValueError(f"sleep: {busy} requests are in flight; abort them or "
                             "pause(mode='wait') until they finish")
        self.drain()
        self._worker_call("sleep", (level,), self.step_timeout)
        self.scheduler.reset_prefix_cache()  # the cached blocks' contents are gone
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self) -> None:
        """Undo `sleep`: weights and KV cache back; held requests are queued."""
        if self.sleep_level:
            # Level 2 reloads the weights: allow what a start-up load is allowed.
            timeout = self.step_timeout
            if timeout is not None and self.sleep_level == 2:
                timeout = max(timeout, envs.engine_ready_timeout_s())
            self._worker_call("wake_up", (self.served_weights_path(),), timeout)
        self.sleep_level = 0
        self._release_held()

    def is_sleeping(self) -> int:
        """The current sleep level (0: awake)."""
        return self.sleep_level

    def is_paused(self) -> bool:
        """True while paused."""
        return self.pause_mode is not None
