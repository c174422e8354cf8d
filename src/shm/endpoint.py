"""One process's end of a ring: the segment, eventfds, handshake and orderly close.

Owns what the writer and reader ends share (``ring.py`` subclasses :class:`Endpoint`): creating
or attaching the segment, the control-block header, the eventfds (one per role: role 0 is the
writer, role ``1 + i`` reader ``i``; each role parks on its own and the others signal it), the
attach handshake, peer watching and closing. Either end may create a ring; the engine core
creates the broadcast ring it writes and the output ring it reads, and workers attach.

Lifecycle: ``create`` (maps the segment and listens for attachers) -> start the peer processes
-> ``wait_attached`` (serves the handshake, then unlinks the segment's name: the mappings stay,
so a later crash of any process leaves nothing in ``/dev/shm``) -> use -> ``close``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from types import TracebackType
from typing import Self

from ringserve.shm import layout as L
from ringserve.shm.errors import RingError
from ringserve.shm.fence import check_platform, full_fence
from ringserve.shm.frames import check_capacity
from ringserve.shm.handshake import AttachListener, request_fds
from ringserve.shm.liveness import PeerWatch
from ringserve.shm.segment import Segment
from ringserve.shm.wait import Waiter, WaitPolicy, WaitStats

MAX_READERS = 64


class Endpoint:
    """Shared plumbing of :class:`~ringserve.shm.ring.RingWriter` and ``RingReader``.

    Not constructed directly: use the subclasses' ``create`` and ``attach``.
    """

    def __init__(
        self,
        segment: Segment,
        role: int,
        efds: list[int],
        listener: AttachListener | None,
        policy: WaitPolicy,
        fence: Callable[[], None],
    ) -> None:
        self._segment = segment
        self._base = memoryview(segment.mapping)
        self._words = self._base.cast("Q")
        words = self._words
        self.capacity: int = words[L.H_CAPACITY]
        self.n_readers: int = words[L.H_READERS]
        offset = words[L.H_DATA_OFFSET]
        self._data = self._base[offset : offset + self.capacity]
        self._data_word = offset // 8
        self._mask = self.capacity - 1
        self._role = role
        self._efds = efds
        self._listener = listener
        self._fence = fence
        self._closed = False
        roles = range(1 + self.n_readers)
        peers = [r for r in roles if r != role] if role == L.WRITER_ROLE else [L.WRITER_ROLE]
        self._watch = PeerWatch(words, peers)
        flag = L.role_word(role, L.R_WAITING)
        self._waiter = Waiter(words, flag, efds[role], self._watch, policy, fence)

    @staticmethod
    def _create_segment(capacity: int, n_readers: int, role: int, label: str) -> Segment:
        check_platform()
        check_capacity(capacity)
        if not 1 <= n_readers <= MAX_READERS:
            raise ValueError(f"n_readers must be in [1, {MAX_READERS}], got {n_readers}")
        if not 0 <= role <= n_readers:
            raise ValueError(f"role {role} does not exist in a ring with {n_readers} readers")
        segment = Segment.create(label, L.segment_bytes(capacity, n_readers))
        with memoryview(segment.mapping) as base, base.cast("Q") as words:
            words[L.H_VERSION] = L.VERSION
            words[L.H_CAPACITY] = capacity
            words[L.H_READERS] = n_readers
            words[L.H_DATA_OFFSET] = L.data_offset(n_readers)
            words[L.H_CREATOR_ROLE] = role
            words[L.role_word(role, L.R_PID)] = os.getpid()
            words[L.H_MAGIC] = L.MAGIC
        return segment

    @classmethod
    def _create(
        cls, capacity: int, n_readers: int, role: int, label: str, policy: WaitPolicy
    ) -> Self:
        segment = cls._create_segment(capacity, n_readers, role, label)
        efds: list[int] = []
        try:
            flags = os.EFD_NONBLOCK | os.EFD_CLOEXEC
            efds = [os.eventfd(0, flags) for _ in range(1 + n_readers)]
            listener = AttachListener(segment.name)
        except BaseException:
            for fd in efds:
                os.close(fd)
            segment.close()
            raise
        return cls(segment, role, efds, listener, policy, full_fence)

    @classmethod
    def _attach(
        cls,
        name: str,
        role: int,
        timeout: float,
        policy: WaitPolicy,
        fence: Callable[[], None] = full_fence,
    ) -> Self:
        check_platform()
        segment = Segment.attach(name)
        try:
            with memoryview(segment.mapping) as base, base.cast("Q") as words:
                if words[L.H_MAGIC] != L.MAGIC or words[L.H_VERSION] != L.VERSION:
                    raise RingError(f"{name} is not a version-{L.VERSION} ringserve ring")
                n_readers = words[L.H_READERS]
                if not 0 <= role <= n_readers:
                    raise ValueError(f"ring {name} has {n_readers} readers, no role {role}")
                pid_word = L.role_word(role, L.R_PID)

                def publish_pid() -> None:
                    words[pid_word] = os.getpid()

                efds = request_fds(name, role, 1 + n_readers, timeout, publish_pid)
        except BaseException:
            segment.close()
            raise
        return cls(segment, role, efds, None, policy, fence)

    @property
    def name(self) -> str:
        """The segment's name, which peers pass to ``attach``."""
        return self._segment.name

    @property
    def stats(self) -> WaitStats:
        """This endpoint's wait counters."""
        return self._waiter.stats

    def wait_attached(self, timeout: float = 30.0) -> None:
        """Creator only: serve the handshake until every other role attached, then unlink.

        A no-op on an attached endpoint or when called again.

        Raises:
            RingTimeoutError: some peers did not attach within ``timeout`` seconds.
        """
        if self._listener is None:
            return
        roles = {r for r in range(1 + self.n_readers) if r != self._role}
        self._listener.serve(roles, self._efds, time.monotonic() + timeout)
        self._listener.close()
        self._listener = None
        self._segment.unlink()

    def _signal_peers(self) -> None:
        for role in self._watch_roles():
            os.eventfd_write(self._efds[role], 1)

    def _watch_roles(self) -> list[int]:
        if self._role == L.WRITER_ROLE:
            return [L.reader_role(i) for i in range(self.n_readers)]
        return [L.WRITER_ROLE]

    def _release_views(self) -> None:
        """Hook for subclasses to release the frame views they handed out."""

    def close(self) -> None:
        """Close this end: tell the peers, wake them, unmap, unlink (creator). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._words[L.role_word(self._role, L.R_CLOSED)] = 1
        full_fence()
        self._signal_peers()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._watch.close()
        for fd in self._efds:
            os.close(fd)
        self._release_views()
        self._data.release()
        self._words.release()
        self._base.release()
        # BufferError: the caller still holds buffers exported from a frame (a numpy array,
        # say). The name is already unlinked; the mapping goes away when those are freed.
        with contextlib.suppress(BufferError):
            self._segment.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
