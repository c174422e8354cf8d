"""Frame format and ring index arithmetic (pure functions, no I/O).

Owns how a frame sits in the ring's data area; ``ring.py`` is the only caller, and the property
tests in ``tests/shm/test_shm_frames.py`` exercise it as plain arithmetic.

Indices are monotonic 64-bit byte counters (they never wrap in practice: 2**64 bytes); the
position in the data area is ``index & (capacity - 1)`` with ``capacity`` a power of two. A frame
is an 8-byte header followed by the payload padded to 8 bytes, so every header is an aligned
8-byte word written with one store. The header packs ``length`` (32 bits), ``kind`` (16 bits)
and ``flags`` (16 bits, the top bit reserved). A frame never straddles the end of the data area:
when it does not fit in what is left before the end, the producer writes a *wrap marker* (a
header with :data:`WRAP_FLAG`) and the frame starts at position 0; the skipped bytes count as
used until the reader passes them. Because of that skip, the largest frame is ``capacity // 2``:
with at most that size, an empty ring always has room for it (either the tail before the end or
the head before the read position is at least half the ring).
"""

from __future__ import annotations

HEADER_BYTES = 8
ALIGN = 8
WRAP_FLAG = 0x8000
USER_FLAGS_MASK = 0x7FFF
MAX_KIND = 0xFFFF
MAX_LENGTH = 0xFFFFFFFF
WRAP_HEADER = WRAP_FLAG << 48


def align8(n: int) -> int:
    """Round ``n`` up to a multiple of 8."""
    return (n + 7) & ~7


def frame_span(payload_bytes: int) -> int:
    """Bytes a frame with ``payload_bytes`` of payload takes on the ring."""
    return HEADER_BYTES + align8(payload_bytes)


def max_span(capacity: int) -> int:
    """The largest frame span a ring of ``capacity`` bytes accepts."""
    return capacity // 2


def max_payload(capacity: int) -> int:
    """The largest payload a ring of ``capacity`` bytes accepts."""
    return max_span(capacity) - HEADER_BYTES


def check_capacity(capacity: int) -> None:
    """Raise ``ValueError`` unless ``capacity`` is a power of two of at least 64 bytes."""
    if capacity < 64 or capacity & (capacity - 1):
        raise ValueError(f"ring capacity must be a power of two >= 64 bytes, got {capacity}")


def wrap_skip(write_index: int, capacity: int, span: int) -> int:
    """Bytes to skip (wrap marker included) before a frame of ``span`` bytes.

    Args:
        write_index: the producer's monotonic write index.
        capacity: the data capacity (a power of two).
        span: the frame's span from :func:`frame_span`.

    Returns:
        0 when the frame fits before the end of the data area, else the bytes left before it.
    """
    room = capacity - (write_index & (capacity - 1))
    return room if span > room else 0


def free_bytes(write_index: int, read_index: int, capacity: int) -> int:
    """Bytes the producer may still write given the slowest reader's ``read_index``."""
    return capacity - (write_index - read_index)


def pack_header(length: int, kind: int, flags: int) -> int:
    """Pack a frame header into one 64-bit word.

    Raises:
        ValueError: a field is out of range (kind > 65535, flags using the reserved top bit).
    """
    if not 0 <= length <= MAX_LENGTH:
        raise ValueError(f"frame length must be in [0, {MAX_LENGTH}], got {length}")
    if not 0 <= kind <= MAX_KIND:
        raise ValueError(f"frame kind must be in [0, {MAX_KIND}], got {kind}")
    if not 0 <= flags <= USER_FLAGS_MASK:
        raise ValueError(f"frame flags must be in [0, {USER_FLAGS_MASK}], got {flags}")
    return length | (kind << 32) | (flags << 48)


def unpack_header(word: int) -> tuple[int, int, int]:
    """Split a header word into ``(length, kind, flags)``; flags keep the wrap bit."""
    return word & MAX_LENGTH, (word >> 32) & MAX_KIND, word >> 48
