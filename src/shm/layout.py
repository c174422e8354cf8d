"""Layout of a ring segment's control block (pure constants and offsets).

Owns where each shared word lives; ``ring.py``, ``wait.py`` and ``liveness.py`` read and write
these words through one ``memoryview.cast("Q")`` of the whole mapping (aligned 8-byte loads and
stores are single instructions on x86-64, so each word is read or written atomically).

A segment is: a 128-byte header block, then one 128-byte block per *role* (role 0 is the writer,
role ``1 + i`` is reader ``i``), then the data area starting on a 4 KiB boundary. 128 bytes keep
every role's hot words off its peers' cache lines, including the adjacent-line prefetcher's pair.
Each role only ever stores into its own block, so no line is written by two processes.
"""

from __future__ import annotations

MAGIC = int.from_bytes(b"RINGSERV", "little")
VERSION = 1
BLOCK_BYTES = 128
PAGE_BYTES = 4096
WORDS_PER_BLOCK = BLOCK_BYTES // 8

# Header block words.
H_MAGIC = 0
H_VERSION = 1
H_CAPACITY = 2
H_READERS = 3
H_DATA_OFFSET = 4
H_CREATOR_ROLE = 5

# Per-role words (offsets inside a role block).
R_INDEX = 0  # writer: write index; reader: read index (published on release)
R_WAITING = 1  # 1 while this role is announced as parked on its eventfd
R_PID = 2  # pid of the process holding the role, 0 until attached
R_CLOSED = 3  # 1 once the role closed in an orderly way

WRITER_ROLE = 0


def reader_role(index: int) -> int:
    """Role number of reader ``index``."""
    return 1 + index


def role_word(role: int, field: int) -> int:
    """Word index (into the mapping cast to u64) of ``field`` in ``role``'s block."""
    return WORDS_PER_BLOCK * (1 + role) + field


def data_offset(n_readers: int) -> int:
    """Byte offset of the data area for a ring with ``n_readers`` readers."""
    control = BLOCK_BYTES * (2 + n_readers)
    return (control + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES


def segment_bytes(capacity: int, n_readers: int) -> int:
    """Total segment size for ``capacity`` data bytes and ``n_readers`` readers."""
    return data_offset(n_readers) + capacity
