"""Shared-memory segments for weights: created with their pages reserved and mapped.

Used by the shm transport (`shm_transport`: its bucket segments, and the receivers' mappings)
and by `shared_weights` (the trainer's parameters moved into one segment); a leaf under both.
"""

from __future__ import annotations

import contextlib
import os

from ringserve.shm.segment import SHM_DIR, Segment
from ringserve.weight_transfer.errors import WeightTransportError

# madvise(2) advice that maps every page of a range at once (Linux 5.14+); Python 3.11's mmap
# module does not name them.
_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23


def prefault(segment: Segment, write: bool) -> None:
    """Map every page of `segment` into this process now, so that the first round does not
    take a page fault per 4 KiB (a first copy into fresh mappings ran at ~0.6 GB/s, against
    ~14 GB/s once mapped). Best effort: an older kernel just faults on first use."""
    with contextlib.suppress(OSError, ValueError):
        segment.mapping.madvise(_MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ)


def create_segment(label: str, size: int) -> Segment:
    """A new segment of `size` bytes, its pages reserved and mapped.

    Raises:
        WeightTransportError: ``/dev/shm`` has no room for it.
    """
    segment = Segment.create(label, size)
    try:
        fd = os.open(os.path.join(SHM_DIR, segment.name), os.O_RDWR | os.O_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    except OSError as exc:
        segment.close()
        raise WeightTransportError(f"cannot reserve {size} bytes in {SHM_DIR} for weights "
                                   f"({exc}); lower bucket_bytes or enlarge {SHM_DIR}"
                                   ) from None
    prefault(segment, write=True)
    return segment
