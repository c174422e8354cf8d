"""Fixtures for the weight-transfer tests: no /dev/shm segment of this process outlives a
test, and the spawned peers (fake engine workers) are shared and always reaped.

The peers are started at this directory's first test when a chosen test uses them, so
their seconds of importing torch overlap the in-process tests that run first.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from wt_peer import Peer, peer_main

from ringserve.shm.segment import SHM_DIR, creator_pid

# test_wt_vllm_loop.py trains and checks with test_weight_sync's helpers (tests/engine);
# appended, so that nothing there shadows a module of this directory.
sys.path.append(str(Path(__file__).resolve().parent.parent / "engine"))

PEERS = 2


def _segments() -> set[str]:
    # Only this process's: other test runs on the machine make ring segments of their own.
    return {n for n in os.listdir(SHM_DIR) if creator_pid(n) == os.getpid()}


@pytest.fixture(autouse=True)
def no_leftover_segments() -> Iterator[None]:
    before = _segments()
    yield
    left = _segments() - before
    assert not left, f"segments left in /dev/shm: {sorted(left)}"


class PeerPool:
    """Spawned peers, replaced when a test killed one."""

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("spawn")
        self.peers: list[Peer] = []

    def _spawn(self) -> Peer:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=peer_main, args=(theirs,), daemon=True,
                                        name="wt-peer")
        process.start()
        theirs.close()
        return Peer(process, ours)

    def get(self, count: int) -> list[Peer]:
        for index, peer in enumerate(self.peers):
            if not peer.alive():
                peer.stop()
                self.peers[index] = self._spawn()
        while len(self.peers) < count:
            self.peers.append(self._spawn())
        return self.peers[:count]

    def stop(self) -> None:
        for peer in self.peers:  # ask every peer first, then wait for each
            peer.ask_to_exit()
        for peer in self.peers:
            peer.stop()
        self.peers = []


_pool: PeerPool | None = None


def _the_pool() -> PeerPool:
    global _pool
    if _pool is None:
        _pool = PeerPool()
    return _pool


@pytest.fixture(scope="session", autouse=True)
def start_peers_early(request: pytest.FixtureRequest) -> Iterator[None]:
    """At this directory's first test: spawn the peers if a chosen test will use them."""
    if any("peer_pool" in getattr(item, "fixturenames", ()) for item in request.session.items):
        _the_pool().get(PEERS)
    try:
        yield
    finally:
        if _pool is not None:
            _pool.stop()


@pytest.fixture(scope="module")
def peer_pool() -> Iterator[PeerPool]:
    """The peers, stopped when the module using them is done (not at the session's end)."""
    try:
        yield _the_pool()
    finally:
        _the_pool().stop()
