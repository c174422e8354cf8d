"""Lock-free shared-memory rings between the engine core and its workers.

Public API: :class:`RingWriter` and :class:`RingReader` (one reader: the SPSC frame ring;
several: the broadcast ring), :class:`Frame`, :class:`WaitPolicy` and :class:`WaitStats`,
:func:`cleanup_stale` for start-up, and the errors. Imports no torch, trio or zmq. Module map:
``frames`` (frame format, index arithmetic), ``layout`` (control block), ``fence`` (the memory
fence), ``wait`` (spin / predict / park), ``liveness`` (peer death), ``poller``, ``handshake``
(eventfd passing), ``segment`` (/dev/shm lifecycle), ``endpoint`` and ``ring`` (the ends),
``bench`` (``ringserve bench ipc``).
"""

from ringserve.shm.errors import (
    CorruptFrameError,
    CorruptRingError,
    FrameTooLargeError,
    PeerDiedError,
    RingClosedError,
    RingError,
    RingTimeoutError,
    UnsupportedPlatformError,
)
from ringserve.shm.ring import Frame, RingReader, RingWriter
from ringserve.shm.segment import cleanup_stale
from ringserve.shm.wait import WaitPolicy, WaitStats

__all__ = [
    "CorruptFrameError",
    "CorruptRingError",
    "Frame",
    "FrameTooLargeError",
    "PeerDiedError",
    "RingClosedError",
    "RingError",
    "RingReader",
    "RingTimeoutError",
    "RingWriter",
    "UnsupportedPlatformError",
    "WaitPolicy",
    "WaitStats",
    "cleanup_stale",
]
