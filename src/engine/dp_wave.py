"""Lockstep of the engine cores of an expert-parallel deployment (`--enable-expert-parallel`
with `--data-parallel-size` > 1): request waves, the consensus that ends one, and the wake-up
that starts one on every core.

With experts partitioned over the workers of every data-parallel rank, each MoE layer of a
forward is a collective over all of them (`ringserve.gpu.moe.dispatch`), so every core must
run a forward whenever any core does: a core with nothing to schedule runs a dummy pass (the
layers' exchanges with no token). The cores step in *waves* (vLLM's request waves): wave n
starts when some core gets work while idle; that core sets the key `wave/n` in the frontend's
TCPStore, and a thread of every core, blocked on the next wave's key, wakes its busy loop.
Within a wave every core runs the same loop: an all-reduce of "I have work" over a gloo group
of the cores (the consensus step, each step), then a real step or a dummy pass. The wave ends
at the consensus step where no core has work; all cores see the same sum, so they leave the
wave together, and all of them count it: the wave number is the same on every core. A wake-up
for a wave that has already ended (a core saw `wave/n` late) is stale and ignored; one for the
next wave, seen before the current one ended here, is kept until it has.

The frontend hosts the store (it outlives the cores); the cores and their workers join groups
under their own key prefixes of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

import torch

from ringserve.gpu.parallel import connect_store, gloo_group

logger = logging.getLogger(__name__)

_WAIT_SLICE = timedelta(seconds=30)


class WaveSync:
    """One core's side of the lockstep.

    Args:
        rank: this core's data-parallel rank.
        size: the number of cores.
        port: the frontend's store.
        timeout_s: how long a consensus step may wait for the other cores.
        on_wake: called from the watcher thread with the number of each wave that starts
            (the core queues it for its busy loop, which calls `note_wake`).
    """

    def __init__(self, rank: int, size: int, port: int, timeout_s: float,
                 on_wake: Callable[[int], None]) -> None:
        self.rank, self.size = rank, size
        self._store = connect_store(port, timeout_s)
        self._group = gloo_group(self._store, "ringserve/cores", rank, size, timeout_s)
        self.number = 0  # waves completed (the same on every core)
        self.running = False
        self._pending = -1  # the highest wave another core started
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, args=(port, timeout_s, on_wake),
                                         daemon=True, name="ringserve-core-waves")
        self._watcher.start()

    def _watch(self, port: int, timeout_s: float, on_wake: Callable[[int], None]) -> None:
        store = connect_store(port, timeout_s)
        wave = 0
        while not self._stop.is_set():
            try:
                store.wait([f"wave/{wave}"], _WAIT_SLICE)
            except RuntimeError:  # no key yet (a timeout), or the store is gone
                continue
            on_wake(wave)
            wave += 1

    def note_wake(self, wave: int) -> None:
        """Wave `wave` has started somewhere (from the watcher, through the busy loop)."""
        self._pending = max(self._pending, wave)

    def wants_to_run(self) -> bool:
        """In a wave, or another core has started the next one."""
        return self.running or self._pending >= self.number

    def enter(self, has_work: bool) -> bool:
        """Join (or start, with local work) the current wave; whether this core is in one."""
        if not self.running:
            if has_work:
                self.running = True
                self._store.set(f"wave/{self.number}", "1")
            elif self._pending >= self.number:
                self.running = True
        return self.running

    def any_work(self, has_work: bool) -> bool:
        """The consensus step: whether any core has work; False ends the wave here (and on
        every core, at the same step)."""
        flag = torch.tensor([1 if has_work else 0], dtype=torch.int64)
        self._group.allreduce([flag]).wait()
        if int(flag.item()):
            return True
        self.number += 1
        self.running = False
        return False

    def close(self) -> None:
        """Stop the watcher (it exits within one wait slice)."""
        self._stop.set()
