"""One-process tests of the ring ends (readers attach from threads)."""

from __future__ import annotations

import os
import random
import stat
import threading
import time

import numpy as np
import pytest
from shm_helpers import attach_in_thread

from ringserve.shm import (
    FrameTooLargeError,
    RingClosedError,
    RingReader,
    RingTimeoutError,
    RingWriter,
    WaitPolicy,
)


def test_random_sizes_wrap_around(ring_pair: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring_pair
    rng = random.Random(1)
    backlog: list[tuple[bytes, int]] = []
    for i in range(5000):
        data = rng.randbytes(rng.randrange(0, 600))
        writer.send(data, kind=i % 9, flags=i % 5)
        backlog.append((data, i))
        if rng.random() < 0.5 or len(backlog) > 2:
            for want, j in backlog:
                frame = reader.recv(1.0)
                assert (bytes(frame.data), frame.kind, frame.flags) == (want, j % 9, j % 5)
            reader.release()
            backlog.clear()
    assert writer._write > 100 * writer.capacity  # wrapped many times


def test_reserve_commit_in_place_and_shorter(ring_pair: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring_pair
    buf = writer.reserve(100)
    assert len(buf) == 100
    buf[:5] = b"hello"
    writer.commit(kind=7, nbytes=5)
    frame = reader.recv(1.0)
    assert (bytes(frame.data), frame.kind) == (b"hello", 7)
    reader.release()
    with pytest.raises(ValueError, match="nbytes"):
        writer.reserve(4)
        writer.commit(nbytes=5)


def test_too_large_frame_names_both_sizes(ring_pair: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring_pair
    with pytest.raises(FrameTooLargeError, match=r"2056 bytes.*capacity 4096"):
        writer.send(b"x" * 2048)
    writer.send(b"x" * (2048 - 8))  # the largest legal frame still goes through
    assert len(reader.recv(1.0).data) == 2040
    reader.release()


def test_unreleased_frame_is_never_overwritten(ring_pair: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring_pair
    writer.send(b"A" * 1000)
    held = reader.recv(1.0)
    with pytest.raises(RingTimeoutError):
        for _ in range(10):
            writer.send(b"B" * 1000, timeout=0.05)
    assert bytes(held.data) == b"A" * 1000
    while True:
        try:
            assert bytes(reader.recv(0.01).data) == b"B" * 1000
        except RingTimeoutError:
            break
    reader.release()
    writer.send(b"C", timeout=0.5)  # space is back
    assert bytes(reader.recv(0.5).data) == b"C"
    reader.release()


def test_released_frame_view_is_invalidated(ring_pair: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring_pair
    writer.send(b"abcdefgh")
    frame = reader.recv(1.0)
    assert np.frombuffer(frame.data, dtype=np.uint8).tobytes() == b"abcdefgh"  # zero-copy
    reader.release()
    with pytest.raises(ValueError, match="released"):
        bytes(frame.data)


def test_recv_timeout(ring_pair: tuple[RingWriter, RingReader]) -> None:
    _, reader = ring_pair
    start = time.monotonic()
    with pytest.raises(RingTimeoutError):
        reader.recv(0.05)
    assert time.monotonic() - start < 1.0


def test_writer_close_drains_then_raises_closed() -> None:
    writer = RingWriter.create(1 << 12, label="close")
    (reader,) = attach_in_thread(writer)
    writer.send(b"last")
    writer.close()
    assert bytes(reader.recv(1.0).data) == b"last"
    reader.release()
    with pytest.raises(RingClosedError):
        reader.recv(2.0)
    reader.close()


def test_broadcast_every_reader_sees_every_frame_in_order() -> None:
    writer = RingWriter.create(1 << 12, n_readers=3, label="bcast")
    readers = attach_in_thread(writer, 3)
    for i in range(300):
        writer.send(i.to_bytes(4, "little"), kind=1)
        for r in readers:
            assert int.from_bytes(r.recv(1.0).data, "little") == i
            r.release()
    for r in readers:
        r.close()
    writer.close()


def test_broadcast_writer_waits_for_slowest_reader() -> None:
    writer = RingWriter.create(1 << 12, n_readers=2, label="slow")
    fast, slow = attach_in_thread(writer, 2)
    sent = 0
    with pytest.raises(RingTimeoutError):
        while True:
            writer.send(b"z" * 200, timeout=0.05)
            sent += 1
            fast.recv(1.0)
            fast.release()
    assert 0 < sent * 208 <= writer.capacity
    for _ in range(sent):
        slow.recv(1.0)
    slow.release()
    writer.send(b"again", timeout=0.5)
    for r in (fast, slow):
        assert bytes(r.recv(0.5).data) == b"again"
        r.close()
    writer.close()


def test_segment_mode_name_and_unlink_after_attach() -> None:
    writer = RingWriter.create(1 << 12, label="mode")
    path = f"/dev/shm/{writer.name}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert writer.name.startswith(f"ringserve-{os.getpid()}-")
    (reader,) = attach_in_thread(writer)
    assert not os.path.exists(path)  # unlinked once every peer attached
    writer.send(b"still mapped")
    assert bytes(reader.recv(1.0).data) == b"still mapped"
    reader.release()
    reader.close()
    writer.close()
    writer.close()  # idempotent, no double unlink


def test_reader_created_ring_writer_attaches() -> None:
    reader = RingReader.create(1 << 12, label="rcreate", policy=WaitPolicy.forced_park())
    box: list[RingWriter] = []
    t = threading.Thread(target=lambda: box.append(RingWriter.attach(reader.name)))
    t.start()
    reader.wait_attached(5.0)
    t.join()
    box[0].send(b"up")
    assert bytes(reader.recv(1.0).data) == b"up"
    reader.release()
    box[0].close()
    reader.close()


def test_unattached_creator_close_unlinks() -> None:
    writer = RingWriter.create(1 << 12, label="noattach")
    with pytest.raises(RingTimeoutError):
        writer.wait_attached(0.05)
    writer.close()


def test_fence_sits_between_publish_and_flag_read() -> None:
    """Both sides must fence after storing (index or waiting flag) and before the peer's word."""
    from ringserve.shm import layout as L

    events: list[str] = []
    writer = RingWriter.create(1 << 12, label="fence")
    (reader,) = attach_in_thread(writer)
    words = writer._words
    windex = L.role_word(L.WRITER_ROLE, L.R_INDEX)
    rflag = L.role_word(L.reader_role(0), L.R_WAITING)

    def writer_fence() -> None:
        events.append(f"writer-fence index={words[windex]}")

    writer._fence = writer_fence
    writer.send(b"12345678")
    assert events == ["writer-fence index=16"]  # the index was already published

    def reader_fence() -> None:
        events.append(f"reader-fence waiting={words[rflag]}")

    reader._waiter._fence = reader_fence
    reader._waiter._policy = WaitPolicy.forced_park()
    reader.recv(1.0)
    reader._fence = lambda: events.append("reader-release-fence")
    reader.release()
    with pytest.raises(RingTimeoutError):
        reader.recv(0.01)  # parks: announce, fence, re-check, sleep
    assert events[1:] == ["reader-release-fence", "reader-fence waiting=1"]
    reader.close()
    writer.close()


def test_cleanup_stale_removes_only_dead_creators() -> None:
    import subprocess

    from ringserve.shm import cleanup_stale

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"/dev/shm/ringserve-{dead.pid}-abcdef-stale"
    live = f"/dev/shm/ringserve-{os.getpid()}-abcdef-live"
    for path in (stale, live):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    try:
        removed = cleanup_stale()
        assert os.path.basename(stale) in removed
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)
