"""Fixtures for the ring tests: no /dev/shm entry and no child process may outlive a test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from shm_helpers import Peers, attach_in_thread

from ringserve.shm import RingReader, RingWriter, WaitPolicy
from ringserve.shm.liveness import pid_alive
from ringserve.shm.segment import creator_pid


def _descends_from_us(pid: int) -> bool:
    """Whether `pid` is this process or one of its descendants (the test's peers)."""
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        try:
            with open(f"/proc/{pid}/stat") as stat:
                pid = int(stat.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _ring_entries() -> set[str]:
    # Segments of this test's process tree. Alone, also those of creators that are gone (a
    # killed peer's leftovers); beside other pytest-xdist workers, a gone creator may be
    # another worker's (a stale-cleanup test makes such names), and their segments are theirs
    # to check.
    alone = "PYTEST_XDIST_WORKER" not in os.environ
    entries = set()
    for name in os.listdir("/dev/shm"):
        pid = creator_pid(name)
        if pid is not None and (_descends_from_us(pid) or (alone and not pid_alive(pid))):
            entries.add(name)
    return entries


@pytest.fixture(autouse=True)
def no_leftover_segments() -> Iterator[None]:
    before = _ring_entries()
    yield
    left = _ring_entries() - before
    assert not left, f"segments left in /dev/shm: {sorted(left)}"


@pytest.fixture
def peers() -> Iterator[Peers]:
    p = Peers()
    yield p
    running = [proc for proc in p.procs if proc.poll() is None]
    for proc in running:
        proc.kill()
        proc.communicate()
    assert not running, "a peer process was still running at the end of the test"


@pytest.fixture
def ring_pair() -> Iterator[tuple[RingWriter, RingReader]]:
    writer = RingWriter.create(1 << 12, label="pair", policy=WaitPolicy(liveness_s=0.05))
    (reader,) = attach_in_thread(writer, policy=WaitPolicy(liveness_s=0.05))
    yield writer, reader
    reader.close()
    writer.close()
