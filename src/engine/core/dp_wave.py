"""Lockstep of the engine cores of an expert-parallel deployment (`--enable-expert-parallel`
with `--data-parallel-size` > 1): request waves, the consensus that ends one, and the wake-up
that starts one on every core.

With experts partitioned over the workers of every data-parallel rank, each MoE layer of a
forward is a collective over all of them (`ringserve.gpu.moe.dispatch`), so every core must
run a forward whenever any core does: a core with nothing to schedule runs a dummy pass (the
layers' exchanges with no token). The cores step in *waves* (vLLM's request waves): wave n
starts when some core gets work while idle; that core sets the key `wave/n` in the frontend's
TCPStore, and a thread of every core, blocked on the next wave's key, wakes its busy loop.
Within a wave every core runs the same loop: a real step or a dummy pass, preceded at the
wave's first step and then every `--dp-sync-interval` steps (default 16, vLLM's) by an
all-reduce of "I have work" over a gloo group of the cores (the consensus step; between two,
every core steps, a core without work by a dummy pass). The wave ends at the consensus step
where no core has work; all cores see the same sum, so they leave the
wave together, and all of them count it: the wave number is the same on every core. A wake-up
for a wave that has already ended (a core saw `wave/n` late) is stale and ignored; one for the
next wave, seen before the current one ended here, is kept until it has.

The frontend hosts the store (it outlives the cores); the cores and their workers join groups
under their own key prefixes of it, numbered by an *epoch*. Faults: a collective with a dead
or silent peer fails (gloo: at once for a closed connection, else after the lockstep timeout,
`--execute-model-timeout-s`, default 60 s), which is an engine fault of that core. Whoever
sees a fault first (the core, or the frontend when a core process dies) *announces* it: the
epoch moves on (compare-and-set, once per epoch) and the key `fault/<epoch>` is set. Every
core watches that key, so an idle core, which is in no collective, faults too: every rank of
the EP group fails its in-flight requests and reports unhealthy. `retry` rebuilds each core's
workers and groups in the new epoch (a restarted core process joins it from the start).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from ringserve.config import EngineConfig
from ringserve.engine.core.faults import LOCKSTEP_DEFAULT_TIMEOUT_S
from ringserve.gpu.layers.parallel import connect_store, gloo_group, serve_store

logger = logging.getLogger(__name__)

# c10d logs a warning each time a store wait times out: the watchers wait long, and `close`
# sets the keys they wait for so that they leave at once.
_WAIT_SLICE = timedelta(hours=1)
EPOCH_KEY = "ringserve/epoch"
DEFAULT_TIMEOUT_S = LOCKSTEP_DEFAULT_TIMEOUT_S


def lockstep_timeout(execute_model_timeout_s: float | None) -> float:
    """How long a collective of the lockstep deployment may wait for a peer."""
    return execute_model_timeout_s or DEFAULT_TIMEOUT_S


def serve_lockstep(config: EngineConfig) -> tuple[Any, EngineConfig]:
    """The frontend's store for a lockstep deployment, at epoch 0, and `config` naming its
    port (the cores and their workers meet there)."""
    store = serve_store()
    store.set(EPOCH_KEY, "0")
    parallel = dataclasses.replace(config.parallel_config,
                                   data_parallel_master_port=int(store.port))
    return store, dataclasses.replace(config, parallel_config=parallel)


def current_epoch(store: Any) -> int:
    """The epoch the groups are (re)built in."""
    return int(store.get(EPOCH_KEY).decode())


def announce_fault(store: Any, epoch: int, reason: str) -> None:
    """End `epoch` (once; later calls for it change nothing) and tell every core."""
    store.compare_set(EPOCH_KEY, str(epoch), str(epoch + 1))
    store.set(f"fault/{epoch}", reason[:500])


class PeerFault(RuntimeError):
    """Another core of the lockstep deployment faulted (or died): this one cannot step."""


class WaveSync:
    """One core's side of the lockstep.

    Args:
        rank: this core's data-parallel rank.
        size: the number of cores.
        port: the frontend's store.
        timeout_s: how long a consensus step may wait for the other cores.
        sync_interval: steps of a wave from one consensus step to the next (>= 1).
        on_wake: called from a watcher thread with (epoch, number) of each wave that starts
            (the core queues it for its busy loop, which calls `note_wake`).
        on_fault: called from a watcher thread with (epoch, reason) when a fault of this
            epoch is announced (the core queues it; its busy loop raises `PeerFault`).
    """

    def __init__(self, rank: int, size: int, port: int, timeout_s: float,
                 on_wake: Callable[[int, int], None],
                 on_fault: Callable[[int, str], None], sync_interval: int = 1) -> None:
        self.rank, self.size = rank, size
        self.sync_interval = sync_interval
        self._step_in_wave = 0  # the same on every core: they enter and leave waves together
        self._store = connect_store(port)
        self.epoch = current_epoch(self._store)
        self._group = gloo_group(self._store, f"ringserve/cores/{self.epoch}", rank, size,
                                 timeout_s)
        self.number = 0  # waves completed in this epoch (the same on every core)
        self.running = False
        self._pending = -1  # the highest wave another core started
        self._watched_wave = 0  # the wave whose key the wave watcher waits for
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._watch_waves, args=(port, timeout_s, on_wake),
                             daemon=True, name="ringserve-core-waves"),
            threading.Thread(target=self._watch_fault, args=(port, timeout_s, on_fault),
                             daemon=True, name="ringserve-core-faults"),
        ]
        for thread in self._threads:
            thread.start()

    def _wait(self, store: Any, key: str) -> bool:
        """Whether `key` appeared (False: stopped, or the store is gone)."""
        while not self._stop.is_set():
            try:
                store.wait([key], _WAIT_SLICE)
                return not self._stop.is_set()
            except RuntimeError:  # not yet (a timeout)
                continue
        return False

    def _watch_waves(self, port: int, timeout_s: float,
                     on_wake: Callable[[int, int], None]) -> None:
        store = connect_store(port)
        while self._wait(store, f"wave/{self.epoch}/{self._watched_wave}"):
            on_wake(self.epoch, self._watched_wave)
            self._watched_wave += 1

    def _watch_fault(self, port: int, timeout_s: float,
                     on_fault: Callable[[int, str], None]) -> None:
        store = connect_store(port)
        key = f"fault/{self.epoch}"
        if self._wait(store, key):
            on_fault(self.epoch, store.get(key).decode(errors="replace"))

    def announce_fault(self, reason: str) -> None:
        """This core faulted: end the epoch for every core (see the module docstring)."""
        announce_fault(self._store, self.epoch, reason)

    def note_wake(self, epoch: int, wave: int) -> None:
        """Wave `wave` of `epoch` has started somewhere (from the watcher, through the busy
        loop); a wake-up of an earlier epoch is stale."""
        if epoch == self.epoch:
            self._pending = max(self._pending, wave)

    def wants_to_run(self) -> bool:
        """In a wave, or another core has started the next one."""
        return self.running or self._pending >= self.number

    def enter(self, has_work: bool) -> bool:
        """Join (or start, with local work) the current wave; whether this core is in one."""
        if not self.running:
            if has_work:
                self.running = True
                self._store.set(f"wave/{self.epoch}/{self.number}", "1")
            elif self._pending >= self.number:
                self.running = True
        return self.running

    def any_work(self, has_work: bool) -> bool:
        """Before each step of a wave: whether to step. At a consensus step (the wave's
        first, then every `sync_interval`), whether any core has work: False ends the wave
        here (and on every core, at the same step); between two, True on every core."""
        step = self._step_in_wave
        self._step_in_wave = step + 1
        if step % self.sync_interval:
            return True
        flag = torch.tensor([1 if has_work else 0], dtype=torch.int64)
        self._group.allreduce([flag]).wait()
        if int(flag.item()):
            return True
        self.number += 1
        self.running = False
        self._step_in_wave = 0
        return False

    def close(self) -> None:
        """Stop the watchers and leave the group (after a fault: the epoch is over, so the
        keys set here wake only watchers of this epoch, which are leaving too)."""
        self._stop.set()
        self._store.set(f"wave/{self.epoch}/{self._watched_wave}", "closed")
        self._store.set(f"fault/{self.epoch}", "closed")
        self._group = None
