"""The ring endpoints: :class:`RingWriter` and :class:`RingReader`.

Owns the hot paths that move frames (see ``frames.py`` for the frame format and ``layout.py``
for the control block). With one reader this is the SPSC ring (a worker's ModelRunnerOutput to
the engine core); with ``n_readers > 1`` it is the broadcast ring (the engine core's
SchedulerOutput to every TP worker): each reader has its own read index, every reader sees every
frame in order, and the writer waits for the slowest.

Ordering: the writer copies the payload, stores the frame header, then stores the write index;
a reader loads the write index, then the header and payload. x86-64 keeps stores in order and
loads in order, so that publication needs no barrier; only the "publish index, then read the
peer's waiter flag" step needs the full fence (``fence.py``, ``wait.py``).

Zero copy: :meth:`RingReader.recv` returns a memoryview into the ring. The reader publishes its
read index only in :meth:`RingReader.release`, so the writer can never overwrite a frame that
has not been released; :meth:`RingWriter.reserve` returns a memoryview to fill in place (msgspec
output or raw tensor bytes go straight in) and :meth:`RingWriter.commit` publishes it.

Validation: the reader checks what it reads from the segment before using it, since a buggy or
hostile peer can write anything there. A frame header must describe a frame that lies wholly
inside what the writer has published and inside the data area, or ``recv`` raises
:class:`CorruptFrameError` after skipping to the writer's index (so the ring stays usable, and a
bad header can never make the reader read out of bounds or walk over stale bytes); a writer
index outside ``[read index, released index + capacity]`` raises :class:`CorruptRingError`.
What a frame's ``kind`` means is the consumer's business: it must drop kinds it does not know.
The header check costs a few integer comparisons per frame (~50 ns in CPython); the index check
runs only when the reader reloads the writer's index.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import NamedTuple, NoReturn

from ringserve.shm import layout as L
from ringserve.shm.endpoint import Endpoint
from ringserve.shm.errors import CorruptFrameError, CorruptRingError, FrameTooLargeError, RingError
from ringserve.shm.fence import full_fence
from ringserve.shm.frames import HEADER_BYTES, WRAP_HEADER, max_span, unpack_header
from ringserve.shm.wait import WaitPolicy

_DEFAULT_POLICY = WaitPolicy()
_LENGTH_MASK = 0xFFFFFFFF


class Frame(NamedTuple):
    """A received frame. ``data`` is valid until the reader's next ``release()``."""

    kind: int
    flags: int
    data: memoryview


class RingWriter(Endpoint):
    """The writing end of a ring (one writer per ring)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._wword = L.role_word(L.WRITER_ROLE, L.R_INDEX)
        self._write: int = self._words[self._wword]
        self._rwords = [L.role_word(L.reader_role(i), L.R_INDEX) for i in range(self.n_readers)]
        self._flags = [
            (L.role_word(L.reader_role(i), L.R_WAITING), self._efds[L.reader_role(i)])
            for i in range(self.n_readers)
        ]
        self._read_floor = 0
        self._max_span = max_span(self.capacity)
        self._frame_at = -1
        self._reserved = 0

    @classmethod
    def create(
        cls,
        capacity: int,
        n_readers: int = 1,
        *,
        label: str = "ring",
        policy: WaitPolicy = _DEFAULT_POLICY,
    ) -> RingWriter:
        """Create a ring and hold its writing end; then start the readers and ``wait_attached``.

        Args:
            capacity: data bytes, a power of two; the largest frame is ``capacity // 2``.
            n_readers: readers, fixed for the ring's life (1: SPSC; more: broadcast).
            label: a short tag for the segment name (``[A-Za-z0-9_]``).
            policy: how this end waits for space.
        """
        return cls._create(capacity, n_readers, L.WRITER_ROLE, label, policy)

    @classmethod
    def attach(
        cls, name: str, *, timeout: float = 30.0, policy: WaitPolicy = _DEFAULT_POLICY
    ) -> RingWriter:
        """Attach as the writer of a ring a reader created."""
        return cls._attach(name, L.WRITER_ROLE, timeout, policy)

    def _min_read(self) -> int:
        words = self._words
        return min([words[i] for i in self._rwords])

    def reserve(self, nbytes: int, timeout: float | None = None) -> memoryview:
        """Reserve a frame of ``nbytes`` payload bytes, waiting for space if the ring is full.

        A second ``reserve`` before ``commit`` replaces the first reservation.

        Returns:
            A writable memoryview of exactly ``nbytes`` bytes inside the ring.

        Raises:
            FrameTooLargeError: the frame could never fit (it exceeds ``capacity // 2``).
            RingTimeoutError, PeerDiedError, RingClosedError: while waiting for space.
        """
        span = HEADER_BYTES + ((nbytes + 7) & ~7)
        if span > self._max_span or nbytes < 0:
            raise FrameTooLargeError(span, self.capacity)
        write = self._write
        pos = write & self._mask
        room = self.capacity - pos
        skip = room if span > room else 0
        need = write + skip + span - self.capacity
        if self._read_floor < need:
            self._read_floor = self._min_read()
            if self._read_floor < need:
                self._wait_space(need, timeout)
        if skip:
            self._words[self._data_word + (pos >> 3)] = WRAP_HEADER
            write += skip
            pos = 0
        self._frame_at = write
        self._reserved = nbytes
        return self._data[pos + HEADER_BYTES : pos + HEADER_BYTES + nbytes]

    def _wait_space(self, need: int, timeout: float | None) -> None:
        def ready() -> bool:
            return self._min_read() >= need

        self._waiter.wait(ready, timeout, "ring space")
        self._read_floor = self._min_read()

    def commit(self, kind: int = 0, flags: int = 0, nbytes: int | None = None) -> None:
        """Publish the reserved frame and wake readers that parked.

        Args:
            kind: a tag for the consumer (0..65535).
            flags: user flags (0..32767; the top bit is the wrap marker).
            nbytes: the payload actually written, at most the reserved size (default: all).
        """
        at = self._frame_at
        if at < 0:
            raise RingError("commit() without a reserve()")
        length = self._reserved if nbytes is None else nbytes
        if not 0 <= length <= self._reserved or kind >> 16 or flags >> 15 or kind < 0 or flags < 0:
            raise ValueError(
                f"commit(kind={kind}, flags={flags}, nbytes={nbytes}): need 0 <= kind <= 65535, "
                f"0 <= flags <= 32767, 0 <= nbytes <= reserved {self._reserved}"
            )
        words = self._words
        words[self._data_word + ((at & self._mask) >> 3)] = length | (kind << 32) | (flags << 48)
        self._frame_at = -1
        self._write = at + HEADER_BYTES + ((length + 7) & ~7)
        words[self._wword] = self._write
        self._fence()
        for flag, efd in self._flags:
            if words[flag]:
                os.eventfd_write(efd, 1)

    def send(
        self,
        data: bytes | bytearray | memoryview,
        kind: int = 0,
        flags: int = 0,
        timeout: float | None = None,
    ) -> None:
        """Copy ``data`` into a new frame and publish it (``reserve`` + copy + ``commit``)."""
        if isinstance(data, memoryview) and data.format != "B":
            data = data.cast("B")
        self.reserve(len(data), timeout)[:] = data
        self.commit(kind, flags)


class RingReader(Endpoint):
    """A reading end of a ring (one per reader index)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._wword = L.role_word(L.WRITER_ROLE, L.R_INDEX)
        self._rword = L.role_word(self._role, L.R_INDEX)
        self._cursor: int = self._words[self._rword]
        self._released = self._cursor
        self._write_seen = self._cursor
        self._views: list[memoryview] = []
        self._writer_flag = L.role_word(L.WRITER_ROLE, L.R_WAITING)
        self._writer_efd = self._efds[L.WRITER_ROLE]

    @classmethod
    def create(
        cls,
        capacity: int,
        n_readers: int = 1,
        *,
        index: int = 0,
        label: str = "ring",
        policy: WaitPolicy = _DEFAULT_POLICY,
    ) -> RingReader:
        """Create a ring and hold reader ``index``'s end (the writer and others attach)."""
        return cls._create(capacity, n_readers, L.reader_role(index), label, policy)

    @classmethod
    def attach(
        cls,
        name: str,
        index: int = 0,
        *,
        timeout: float = 30.0,
        policy: WaitPolicy = _DEFAULT_POLICY,
        fence: Callable[[], None] = full_fence,
    ) -> RingReader:
        """Attach as reader ``index`` of a ring the writer (or another reader) created."""
        return cls._attach(name, L.reader_role(index), timeout, policy, fence)

    def recv(self, timeout: float | None = None) -> Frame:
        """The next frame, waiting for one if none is ready.

        The frame's ``data`` is a view into the ring, valid until :meth:`release`; several
        frames may be held at once and are released together.

        Raises:
            RingTimeoutError: no frame within ``timeout`` seconds.
            PeerDiedError: the writer died and every frame it published has been read.
            RingClosedError: the writer closed and every frame has been read.
            CorruptFrameError: the next frame's header is invalid; everything the writer had
                published was skipped (call ``release`` to hand it back, then ``recv`` again).
            CorruptRingError: the writer's index is invalid; the ring cannot be read further.
        """
        start = cursor = self._cursor
        write = self._write_seen
        if cursor >= write:
            write = self._load_write(cursor)
            if cursor >= write:
                self._wait_data(cursor, timeout)
                write = self._load_write(cursor)
        words = self._words
        pos = cursor & self._mask
        header = words[self._data_word + (pos >> 3)]
        if header == WRAP_HEADER:
            cursor += self.capacity - pos
            pos = 0
            header = words[self._data_word]
        length = header & _LENGTH_MASK
        at = pos + HEADER_BYTES
        end = at + ((length + 7) & ~7)  # where the frame ends in the data area
        lap = cursor - pos
        # The writer publishes whole frames that never straddle the end of the data area, and
        # only the wrap marker (handled above) sets the top flag bit: `>= WRAP_HEADER` tests it.
        if lap + end > write or end > self.capacity or header >= WRAP_HEADER:
            self._skip_corrupt(start, header, write)
        view = self._data[at : at + length]
        self._cursor = lap + end
        self._views.append(view)
        return Frame((header >> 32) & 0xFFFF, header >> 48, view)

    def _load_write(self, cursor: int) -> int:
        """The writer's published index, checked against the ring's invariant."""
        write: int = self._words[self._wword]
        if write - self._released > self.capacity or write < cursor:
            raise CorruptRingError(
                f"ring {self.name}: the writer's index {write} is not within [{cursor}, "
                f"{self._released + self.capacity}] (this reader's read index and one capacity "
                "past its released index): the control block is corrupt"
            )
        self._write_seen = write
        return write

    def _skip_corrupt(self, at: int, header: int, write: int) -> NoReturn:
        self._cursor = write  # the writer's index is always a frame boundary
        length, kind, flags = unpack_header(header)
        raise CorruptFrameError(
            f"ring {self.name}: the frame header at index {at} (length {length}, kind {kind}, "
            f"flags {flags:#x}) does not fit the {write - at} bytes published up to index "
            f"{write}; skipped them"
        )

    def _wait_data(self, cursor: int, timeout: float | None) -> None:
        words = self._words
        wword = self._wword

        def ready() -> bool:
            return words[wword] > cursor

        self._waiter.wait(ready, timeout, "frame")

    def release(self) -> None:
        """Give every frame received so far back to the writer.

        Their ``data`` views are released (using one afterwards raises ``ValueError``); objects
        built over them (casts, numpy arrays) must be dropped before, since the writer may
        overwrite those bytes from now on.

        Raises:
            BufferError: a frame's view itself is still exported (``PyObject_GetBuffer``).
        """
        views = self._views
        while views:
            views[-1].release()
            views.pop()
        if self._cursor == self._released:
            return
        self._released = self._cursor
        words = self._words
        words[self._rword] = self._cursor
        self._fence()
        if words[self._writer_flag]:
            os.eventfd_write(self._writer_efd, 1)

    def _release_views(self) -> None:
        for view in self._views:
            # Still exported by the caller: Endpoint.close leaves the mapping to the GC.
            with contextlib.suppress(BufferError):
                view.release()
        self._views.clear()
