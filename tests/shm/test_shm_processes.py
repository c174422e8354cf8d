"""Two-process tests: checksummed streams, broadcast, lost wake-ups, peer death."""

from __future__ import annotations

import os
import signal
import time

import pytest
from shm_helpers import Peers
from shm_peer import STOP, payloads

from ringserve.shm import PeerDiedError, RingReader, RingWriter, WaitPolicy

# 100k forced-park round trips (the number): each costs two eventfd wake-ups; measured
# 2.4-3.2 s in total on the 2-core dev VM, well inside the suite's budget.
LOST_WAKEUP_ROUND_TRIPS = 100_000
STREAM_FRAMES = 1_000_000


def _parse(line: str) -> dict[str, int]:
    fields = line.split()
    assert fields[0] == "ok", line
    return {k: int(v) for k, v in (f.split("=") for f in fields[1:])}


def _stream(writer: RingWriter, count: int, seed: int) -> None:
    pool = payloads(seed)
    send = writer.send
    for seq in range(count):
        send(seq.to_bytes(8, "little") + pool[seq & 255], seq & 7, 0, 20.0)


@pytest.mark.slow
def test_million_checksummed_frames_two_processes(peers: Peers) -> None:
    with RingWriter.create(1 << 16, label="million") as writer:
        child = peers.start("consume", writer.name, 0, STREAM_FRAMES, 7)
        writer.wait_attached(30.0)
        _stream(writer, STREAM_FRAMES, 7)
        assert _parse(peers.finish(child))["frames"] == STREAM_FRAMES


@pytest.mark.slow
def test_broadcast_three_readers_one_slow(peers: Peers) -> None:
    count = 50_000
    with RingWriter.create(1 << 15, n_readers=3, label="bcast3") as writer:
        kids = [
            peers.start("consume", writer.name, i, count, 11, "slow" if i == 1 else "fast")
            for i in range(3)
        ]
        writer.wait_attached(30.0)
        _stream(writer, count, 11)
        for kid in kids:
            assert _parse(peers.finish(kid))["frames"] == count
        assert writer.stats.waits > 0  # the slow reader held the writer back


@pytest.mark.slow
def test_no_lost_wakeup_with_forced_parking(peers: Peers) -> None:
    park = WaitPolicy(park_only=True, predict=False, liveness_s=0.5)
    with (
        RingWriter.create(1 << 12, label="ping", policy=park) as out,
        RingReader.create(1 << 12, label="pong", policy=park) as back,
    ):
        child = peers.start("echo", out.name, back.name, "park")
        out.wait_attached(30.0)
        back.wait_attached(30.0)
        start = time.monotonic()
        for i in range(LOST_WAKEUP_ROUND_TRIPS):
            out.send(i.to_bytes(8, "little"), 1)
            frame = back.recv(5.0)
            assert int.from_bytes(frame.data, "little") == i
            back.release()
        elapsed = time.monotonic() - start
        out.send(b"", STOP)
        stats = _parse(peers.finish(child))
    assert stats["echoed"] == LOST_WAKEUP_ROUND_TRIPS
    mine = back.stats
    assert mine.parks > LOST_WAKEUP_ROUND_TRIPS // 2, "parking was not exercised"
    assert mine.lost_wakeups == 0 and stats["lost_wakeups"] == 0
    assert mine.ticks == 0 and stats["ticks"] == 0, "a parked side slept through a frame"
    # A single lost wake-up would cost a 0.5 s liveness tick; none happened.
    assert elapsed < LOST_WAKEUP_ROUND_TRIPS * 1e-3


def _kill_and_time_raise(proc_pid: int, action: object) -> float:
    os.kill(proc_pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(PeerDiedError):
        for _ in range(1_000_000):
            action()  # type: ignore[operator]
    return time.monotonic() - start


def test_writer_killed_reader_raises_within_2s(peers: Peers) -> None:
    with RingReader.create(1 << 12, label="wdies") as reader:
        child = peers.start("produce", reader.name, -1)
        reader.wait_attached(30.0)
        for _ in range(1000):
            reader.recv(10.0)
            reader.release()

        def recv() -> None:
            reader.recv(10.0)
            reader.release()

        assert _kill_and_time_raise(child.pid, recv) < 2.0
        child.communicate()


def test_reader_killed_writer_raises_within_2s(peers: Peers) -> None:
    with RingWriter.create(1 << 16, label="rdies") as writer:
        child = peers.start("consume", writer.name, 0, 10**9, 3)
        writer.wait_attached(30.0)
        _stream(writer, 2000, 3)
        assert _kill_and_time_raise(child.pid, lambda: writer.send(b"x" * 64, timeout=10.0)) < 2.0
        child.communicate()
