"""Waiting for the other side of a ring: bounded adaptive spin, prediction, eventfd parking.

Owns :class:`Waiter` (one per ring endpoint) and its :class:`WaitPolicy`. ``ring.py`` calls
:meth:`Waiter.wait` only after a cheap check found no data (reader) or no space (writer), and
calls :func:`notify` after publishing an index. Nothing here knows about frames.

A wait goes through up to three phases:

1. **Prediction.** Under a steady stream (one frame per decode step, say) the waiter keeps an
   EWMA of the interval between arrivals and its jitter. If the next frame is not expected for
   a while, it parks (announced, so an early frame still wakes it) until ``margin`` before the
   expected arrival, then spins through the expected arrival. A 5 ms stream thus costs a few
   hundred microseconds of spinning per frame instead of the whole gap, and the frame is still
   caught by a spinning reader (no wake-up latency).
2. **Bounded spin.** Poll the shared index for at most ``spin`` seconds. The window adapts: it
   tracks twice the recent wait durations, clamped to ``[spin_min_s, spin_max_s]``, so it
   covers hot round trips and shrinks to almost nothing when waits are long (idle) -- it can
   never become permanent spinning.
3. **Park.** Announce ``waiting = 1`` in this role's control block, issue a full fence
   (``fence.full_fence``), re-check, and only then sleep in ``select`` on this role's eventfd
   plus the peers' pidfds. The peer, after publishing its index, fences and reads the flag and
   writes the eventfd only if it is set (:func:`notify`). The two fences make the handshake
   immune to x86 store->load reordering (see ``fence.py``); a wake-up can be spurious (a stale
   eventfd count) but never lost. Every park is bounded by ``liveness_s`` so a peer that died
   without its pidfd firing is still noticed (:class:`~ringserve.shm.liveness.PeerWatch`).

:class:`WaitStats` counts what happened; ``lost_wakeups`` counts parks that ran out their whole
liveness tick although the awaited data was already there -- the signature of a lost wake-up,
which the tests require to stay zero.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from ringserve.shm.errors import RingTimeoutError
from ringserve.shm.fence import full_fence
from ringserve.shm.liveness import PeerWatch
from ringserve.shm.poller import wait_readable

_now = time.perf_counter


@dataclass(frozen=True)
class WaitPolicy:
    """How a ring endpoint waits.

    Attributes:
        spin_min_s: smallest spin window (seconds).
        spin_max_s: largest spin window; bounds the CPU burnt per wait before parking.
        park_only: skip spinning and prediction and park at once (tests, benchmarks).
        predict: learn a steady stream's interval and park until shortly before each frame.
        margin_s: smallest lead by which a predictive park wakes before the expected frame.
        liveness_s: a parked wait re-checks its peers at least this often.
    """

    spin_min_s: float = 2e-6
    spin_max_s: float = 100e-6
    park_only: bool = False
    predict: bool = True
    margin_s: float = 150e-6
    liveness_s: float = 0.1

    @classmethod
    def forced_park(cls) -> WaitPolicy:
        """A policy that always parks on the eventfd (no spin, no prediction)."""
        return cls(park_only=True, predict=False)


@dataclass(slots=True)
class WaitStats:
    """Counters of one endpoint's waits (process-local)."""

    waits: int = 0
    spun: int = 0
    parks: int = 0
    signaled: int = 0
    ticks: int = 0
    predicted: int = 0
    lost_wakeups: int = 0


def notify(words: memoryview, flag_word: int, efd: int) -> None:
    """Wake a peer parked on ``efd`` if it announced itself (call after a full fence)."""
    if words[flag_word]:
        os.eventfd_write(efd, 1)


def _drain(efd: int) -> None:
    # BlockingIOError: the count was already consumed (a spurious wake-up, harmless).
    with contextlib.suppress(BlockingIOError):
        os.eventfd_read(efd)


class Waiter:
    """Waits for one endpoint of a ring.

    Args:
        words: the segment mapping cast to unsigned 64-bit words.
        flag_word: index of this endpoint's ``waiting`` word.
        efd: this endpoint's eventfd (non-blocking).
        watch: the peers to check while parked.
        policy: the waiting policy.
        fence: the store->load fence (tests swap in ``fence.no_fence`` to see it matter).
    """

    def __init__(
        self,
        words: memoryview,
        flag_word: int,
        efd: int,
        watch: PeerWatch,
        policy: WaitPolicy,
        fence: Callable[[], None] = full_fence,
    ) -> None:
        self.stats = WaitStats()
        self._words = words
        self._flag = flag_word
        self._efd = efd
        self._watch = watch
        self._policy = policy
        self._fence = fence
        self._spin = policy.spin_max_s
        self._last_ready = 0.0
        self._interval = 0.0
        self._jitter = 0.0
        self._oversleep = 0.0
        self._oversleep_dev = 0.0

    def wait(self, ready: Callable[[], bool], timeout: float | None, what: str) -> None:
        """Return once ``ready()`` is true.

        Args:
            ready: the condition (reads shared indices; must be cheap).
            timeout: seconds, or None to wait for as long as the peers live.
            what: what is awaited, for the timeout message ("a frame", "ring space").

        Raises:
            RingTimeoutError: ``timeout`` passed.
            PeerDiedError: a peer died while this side waited.
            RingClosedError: a peer closed its end while this side waited.
        """
        start = _now()
        self.stats.waits += 1
        deadline = math.inf if timeout is None else start + timeout
        if not self._policy.park_only and self._spin_phase(ready, start, deadline):
            self._arrived(start)
            return
        while True:
            now = _now()
            if now >= deadline:
                raise RingTimeoutError(f"no {what} within {timeout} s")
            if self._park(ready, min(deadline, now + self._policy.liveness_s), tick=True):
                self._arrived(start)
                return
            self._watch.check()

    def _spin_phase(self, ready: Callable[[], bool], start: float, deadline: float) -> bool:
        spin = self._spin
        if self._policy.predict and self._interval > 0.0:
            margin = self._margin()
            wake_at = self._last_ready + self._interval - margin
            if margin < self._interval / 2 and wake_at - start > spin + margin:
                self.stats.predicted += 1
                signaled = self.stats.signaled
                if self._park(ready, min(wake_at, deadline), tick=False):
                    self._learn_oversleep(wake_at, self.stats.signaled != signaled)
                    return True
                self._learn_oversleep(wake_at, False)
                spin += 2.0 * margin
        end = min(_now() + spin, deadline)
        while _now() < end:
            if ready():
                self.stats.spun += 1
                return True
        return False

    def _margin(self) -> float:
        """How long before an expected frame a predictive park must end."""
        base = max(self._policy.margin_s, 3.0 * self._jitter)
        return base + self._oversleep + 2.0 * self._oversleep_dev

    def _learn_oversleep(self, wake_at: float, too_late: bool) -> None:
        """Track how late timed parks wake (timer slack, scheduler latency in VMs)."""
        if too_late:  # the frame beat our wake-up: widen the margin
            self._oversleep = self._oversleep * 1.5 + 20e-6
            return
        late = max(_now() - wake_at, 0.0)
        if late > self._interval:  # woke by the frame itself, not the timer: no information
            return
        err = late - self._oversleep
        self._oversleep += err * 0.125
        self._oversleep_dev += (abs(err) - self._oversleep_dev) * 0.25

    def _park(self, ready: Callable[[], bool], until: float, tick: bool) -> bool:
        words = self._words
        words[self._flag] = 1
        self._fence()
        if ready():
            words[self._flag] = 0
            return True
        self.stats.parks += 1
        readable = wait_readable([self._efd, *self._watch.fds()], until - _now())
        if self._efd in readable:
            _drain(self._efd)
            self.stats.signaled += 1
        words[self._flag] = 0
        if ready():
            if not readable and tick:
                self.stats.lost_wakeups += 1
            return True
        if not readable and tick:
            self.stats.ticks += 1
        return False

    def _arrived(self, start: float) -> None:
        now = _now()
        policy = self._policy
        target = min(policy.spin_max_s, max(policy.spin_min_s, 2.0 * (now - start)))
        self._spin += (target - self._spin) * 0.25
        if self._last_ready > 0.0:
            gap = now - self._last_ready
            if self._interval == 0.0:
                self._interval = gap
            else:
                # Clipped, so one late frame (a sender's oversleep, a GC pause) does not blow
                # the jitter up and switch prediction off for dozens of frames.
                bound = self._interval * 0.5
                err = min(max(gap - self._interval, -bound), bound)
                self._interval += err * 0.125
                self._jitter += (abs(err) - self._jitter) * 0.125
        self._last_ready = now
