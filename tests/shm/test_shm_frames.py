"""Property tests for the frame format and index arithmetic (ringserve.shm.frames)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.shm import frames as F

capacities = st.sampled_from([64, 128, 1024, 4096, 1 << 16])


@given(st.integers(0, F.MAX_LENGTH), st.integers(0, F.MAX_KIND), st.integers(0, F.USER_FLAGS_MASK))
def test_header_round_trips(length: int, kind: int, flags: int) -> None:
    word = F.pack_header(length, kind, flags)
    assert word < 1 << 64
    assert F.unpack_header(word) == (length, kind, flags)
    assert word != F.WRAP_HEADER


@pytest.mark.parametrize(("length", "kind", "flags"), [(-1, 0, 0), (0, 1 << 16, 0), (0, 0, F.WRAP_FLAG)])
def test_header_rejects_out_of_range(length: int, kind: int, flags: int) -> None:
    with pytest.raises(ValueError):
        F.pack_header(length, kind, flags)


@given(st.integers(0, 1 << 40))
def test_frame_span_is_aligned_and_tight(n: int) -> None:
    span = F.frame_span(n)
    assert span % F.ALIGN == 0
    assert F.HEADER_BYTES + n <= span < F.HEADER_BYTES + n + F.ALIGN


@given(capacities, st.integers(0, 1 << 50), st.data())
def test_wrap_skip_places_frame_inside_data_area(capacity: int, write: int, data: st.DataObject) -> None:
    write -= write % F.ALIGN
    span = data.draw(st.integers(F.HEADER_BYTES, F.max_span(capacity)).map(lambda s: s - s % 8))
    skip = F.wrap_skip(write, capacity, span)
    start = (write + skip) % capacity
    assert start + span <= capacity
    assert skip == 0 or (start == 0 and skip >= F.HEADER_BYTES)


@settings(max_examples=200)
@given(capacities, st.lists(st.tuples(st.integers(0, 2000), st.booleans()), max_size=300))
def test_model_ring_never_overwrites_unreleased_bytes(
    capacity: int, ops: list[tuple[int, bool]]
) -> None:
    """Simulate writer/reader index arithmetic; frames must never overlap live bytes."""
    write = read = 0
    live: list[tuple[int, int]] = []  # [start, end) absolute indices of unreleased frames
    for payload, consume in ops:
        if consume and live:
            read = live.pop(0)[1]
            continue
        span = F.frame_span(payload % (F.max_payload(capacity) + 1))
        skip = F.wrap_skip(write, capacity, span)
        if F.free_bytes(write, read, capacity) < skip + span:
            if not live:  # an empty ring must always take any legal frame
                raise AssertionError("legal frame refused by an empty ring")
            continue
        start = write + skip
        assert start - read + span <= capacity
        live.append((write, start + span))
        write = start + span
    assert 0 <= write - read <= capacity


def test_max_payload_and_capacity_checks() -> None:
    assert F.max_payload(1024) == 512 - 8
    for bad in (0, 32, 100, 1000):
        with pytest.raises(ValueError):
            F.check_capacity(bad)
    F.check_capacity(64)
