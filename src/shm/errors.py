"""Errors raised by the shared-memory rings.

Owns the exception hierarchy of ``ringserve.shm``. Every ring error derives from
:class:`RingError`; callers in the engine core and the workers catch :class:`PeerDiedError` to
turn a dead peer into an engine fault (ARCHITECTURE.md section 6) instead of a hang.
"""

from __future__ import annotations


class RingError(Exception):
    """Base class for every error raised by ``ringserve.shm``."""


class FrameTooLargeError(RingError, ValueError):
    """A frame cannot fit in the ring, whatever the readers do.

    Attributes:
        frame_bytes: the frame's size on the ring (header plus padded payload).
        capacity: the ring's data capacity in bytes.
    """

    def __init__(self, frame_bytes: int, capacity: int) -> None:
        self.frame_bytes = frame_bytes
        self.capacity = capacity
        super().__init__(
            f"frame of {frame_bytes} bytes (with its 8-byte header and padding) does not fit a "
            f"ring of capacity {capacity} bytes: the largest frame is capacity/2 = "
            f"{capacity // 2} bytes; create the ring with capacity >= {2 * frame_bytes}"
        )


class RingTimeoutError(RingError, TimeoutError):
    """A wait (for data, for space, or for peers to attach) passed its timeout."""


class PeerDiedError(RingError):
    """The process on the other side of the ring died (its pid is gone)."""


class RingClosedError(RingError):
    """The other side closed the ring in an orderly way and nothing is left to read."""


class CorruptFrameError(RingError):
    """A frame header that no `RingWriter` writes: the reader skipped it and what follows.

    The header's length runs past the data the writer has published or past the end of the data
    area, or it sets the reserved wrap bit without being the wrap marker. The reader cannot know
    where the next frame starts, so it moves on to the writer's published index (always a frame
    boundary), dropping the bytes in between; ``release()`` hands them back to the writer. The
    ring stays usable: the next ``recv`` returns the next frame the writer publishes.
    """


class CorruptRingError(RingError):
    """The writer's published index breaks the ring's invariant: nothing more can be read.

    A writer is never more than ``capacity`` bytes ahead of a reader's released index, nor
    behind what that reader has already read. An index that says otherwise means the control
    block was overwritten (or the writer is not a `RingWriter`); the ring is unusable.
    """


class UnsupportedPlatformError(RingError):
    """The rings rely on x86-64 ordering and Linux eventfds (see ``fence.py``)."""
