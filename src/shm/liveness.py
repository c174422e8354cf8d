"""Peer liveness: is the process on the other side of a ring still alive?

Owns :func:`pid_alive` (used by ``segment.py``'s stale cleanup) and :class:`PeerWatch` (used by
``wait.py`` while a side is parked). A ring stores each role's pid in its control block
(``layout.R_PID``); the watch opens a ``pidfd`` for every peer pid it finds, so a parked waiter
can put those descriptors in the same ``select`` as its eventfd and learn of a peer's death the
moment it exits (a pidfd turns readable at exit, before the zombie is reaped, and never refers to
a recycled pid). Where ``pidfd_open`` is unavailable (old kernels, seccomp filters) the waiter's
periodic liveness tick falls back to reading ``/proc/<pid>/stat``, where a zombie counts as dead.
"""

from __future__ import annotations

import os

from ringserve.shm.errors import PeerDiedError, RingClosedError
from ringserve.shm.layout import R_CLOSED, R_PID, WRITER_ROLE, role_word
from ringserve.shm.poller import wait_readable


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a running (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read()
    except FileNotFoundError:
        return False
    except OSError:
        return _kill_probe(pid)
    # The state letter follows the last ")" (the command name may itself contain ")").
    state = fields[fields.rfind(b")") + 2 : fields.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"x")


def _kill_probe(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _role_name(role: int) -> str:
    return "writer" if role == WRITER_ROLE else f"reader {role - 1}"


class PeerWatch:
    """Watches the peers of one ring endpoint.

    Args:
        words: the segment mapping cast to unsigned 64-bit words.
        peer_roles: the roles whose death or close this endpoint must notice.
    """

    def __init__(self, words: memoryview, peer_roles: list[int]) -> None:
        self._words = words
        self._roles = peer_roles
        self._pids: dict[int, int] = {}
        self._pidfds: dict[int, int] = {}

    def fds(self) -> list[int]:
        """Pidfds of the peers seen so far (readable once that peer has exited)."""
        self._resolve()
        return list(self._pidfds.values())

    def check(self) -> None:
        """Raise if a peer died or closed.

        Raises:
            PeerDiedError: a peer's process is gone.
            RingClosedError: a peer closed its end in an orderly way.
        """
        self._resolve()
        for role in self._roles:
            if self._words[role_word(role, R_CLOSED)]:
                raise RingClosedError(f"the ring's {_role_name(role)} closed its end")
            pid = self._pids.get(role)
            if pid is not None and self._dead(role, pid):
                raise PeerDiedError(
                    f"the ring's {_role_name(role)} (pid {pid}) died; no more frames can come"
                )

    def _dead(self, role: int, pid: int) -> bool:
        pidfd = self._pidfds.get(role)
        if pidfd is not None:
            return bool(wait_readable([pidfd], 0.0))
        return not pid_alive(pid)

    def _resolve(self) -> None:
        if len(self._pids) == len(self._roles):
            return
        for role in self._roles:
            pid = self._words[role_word(role, R_PID)]
            if pid and role not in self._pids:
                self._pids[role] = pid
                try:
                    self._pidfds[role] = os.pidfd_open(pid)
                except ProcessLookupError:
                    pass  # already exited: check() finds it dead through /proc
                except OSError:
                    pass  # pidfd_open unavailable here: check() polls /proc instead

    def close(self) -> None:
        """Close the pidfds."""
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
