"""Fixtures for the ring tests: no /dev/shm entry and no child process may outlive a test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from shm_helpers import Peers, attach_in_thread

from ringserve.shm import RingReader, RingWriter, WaitPolicy


def _ring_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("ringserve-")}


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
