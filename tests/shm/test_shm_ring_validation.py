"""A reader never trusts a frame header or the writer's index: a bogus one is skipped or refused,
never read out of bounds, never looped over. The bogus words are written straight into the
segment, as a buggy or hostile peer could."""

from __future__ import annotations

import random

import pytest

from ringserve.shm import (
    CorruptFrameError,
    CorruptRingError,
    RingReader,
    RingTimeoutError,
    RingWriter,
)
from ringserve.shm.frames import WRAP_HEADER, frame_span, pack_header


def _header_word(writer: RingWriter, payload: int) -> int:
    """Index (into the mapping's u64 words) of the header of the frame just sent."""
    at = writer._write - frame_span(payload)
    return writer._data_word + ((at & writer._mask) >> 3)


def _send_patched(writer: RingWriter, payload: bytes, header: int) -> None:
    """Send a frame, then overwrite its header (the reader has not looked at it yet)."""
    writer.send(payload, kind=1)
    writer._words[_header_word(writer, len(payload))] = header


def _recv_bytes(reader: RingReader) -> bytes:
    data = bytes(reader.recv(1.0).data)
    reader.release()
    return data


@pytest.mark.parametrize("header", [
    pack_header(1000, 1, 0),                   # runs past what the writer published
    pack_header(0xFFFFFFFF, 1, 0),             # the largest length a header can hold
    16 | (1 << 32) | (0x8001 << 48),           # the reserved wrap bit, not the wrap marker
    WRAP_HEADER,                               # a wrap marker where the writer did not wrap
], ids=["past-published", "max-length", "reserved-flag", "stray-wrap"])
def test_bogus_header_skips_to_the_write_index(
    ring_pair: tuple[RingWriter, RingReader], header: int
) -> None:
    writer, reader = ring_pair
    writer.send(b"before")
    _send_patched(writer, b"x" * 16, header)
    writer.send(b"published after it")
    assert _recv_bytes(reader) == b"before"
    with pytest.raises(CorruptFrameError, match="skipped"):
        reader.recv(1.0)
    reader.release()
    with pytest.raises(RingTimeoutError):  # everything published was skipped, nothing is left
        reader.recv(0.01)
    writer.send(b"next")
    assert _recv_bytes(reader) == b"next"


def test_header_crossing_the_end_of_the_data_area(ring_pair: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring_pair
    for size in (2000, 2000, 56):  # spans 2008 + 2008 + 64: the next frame starts at 4080
        writer.send(b"f" * size)
        _recv_bytes(reader)
    assert writer._write & writer._mask == writer.capacity - 16
    writer.send(b"8 bytes!")  # fills the last 16 bytes exactly
    word = _header_word(writer, 8)
    writer.send(b"y" * 100)  # wraps: the write index is far enough for a longer frame at 4080
    writer._words[word] = pack_header(16, 1, 0)  # 24 bytes from 4080 would cross the end
    with pytest.raises(CorruptFrameError):
        reader.recv(1.0)
    reader.release()
    writer.send(b"after")
    assert _recv_bytes(reader) == b"after"


def test_release_after_a_skip_gives_the_space_back(ring_pair: tuple[RingWriter, RingReader]) -> None:
    writer, reader = ring_pair
    _send_patched(writer, b"x" * 1000, pack_header(5000, 1, 0))
    for _ in range(2):
        writer.send(b"y" * 1000, timeout=0.5)
    with pytest.raises(CorruptFrameError):
        reader.recv(1.0)
    reader.release()
    for _ in range(3):  # 3 KiB more only fits in a 4 KiB ring if the skipped bytes came back
        writer.send(b"z" * 1000, timeout=0.5)
    assert [_recv_bytes(reader) for _ in range(3)] == [b"z" * 1000] * 3


@pytest.mark.parametrize("offset", [4096 + 8, -8], ids=["ahead", "behind"])
def test_bogus_write_index_is_refused(ring_pair: tuple[RingWriter, RingReader], offset: int) -> None:
    writer, reader = ring_pair
    writer.send(b"a" * 8)
    assert _recv_bytes(reader) == b"a" * 8
    real = writer._words[writer._wword]
    writer._words[writer._wword] = real + offset  # past one capacity ahead, or behind the reader
    with pytest.raises(CorruptRingError, match="control block is corrupt"):
        reader.recv(1.0)
    writer._words[writer._wword] = real
    writer.send(b"b")  # the reader read nothing meanwhile and carries on
    assert _recv_bytes(reader) == b"b"


def test_random_bytes_over_the_data_area_are_never_read_out_of_bounds(
    ring_pair: tuple[RingWriter, RingReader],
) -> None:
    writer, reader = ring_pair
    rng = random.Random(7)
    for trial in range(200):
        sizes = [rng.randrange(0, 300) for _ in range(rng.randrange(1, 8))]
        for size in sizes:
            writer.send(b"\0" * size)
        garbage = rng.randbytes(writer.capacity)
        if trial % 2:  # mostly small lengths, so that some garbage headers look plausible
            garbage = bytes(b if i % 8 >= 2 else b & 0x3F for i, b in enumerate(garbage))
        writer._data[:] = garbage
        end = writer._write
        for _ in range(writer.capacity // 8 + 1):  # each frame or skip consumes >= 8 bytes
            if reader._cursor >= end:
                break
            try:
                frame = reader.recv(1.0)
            except CorruptFrameError:
                continue
            assert len(frame.data) <= writer.capacity // 2
        else:
            pytest.fail("the reader kept returning frames past the published data")
        assert reader._cursor == end
        reader.release()
