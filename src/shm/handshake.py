"""Attach handshake: hand a ring's eventfds to the processes that attach to it.

Owns the short-lived Unix socket through which an attaching process gets the ring's eventfds
(file descriptors cannot be named like the segment, so they travel as ``SCM_RIGHTS``). Only
``ring.py`` talks to it: the creator binds an :class:`AttachListener` when it creates the ring
and serves it in ``wait_attached()``; each attacher calls :func:`request_fds` once.

The socket lives in Linux's abstract namespace (``"\\0ringserve-shm/<segment name>"``): it has no
file to clean up and vanishes with its last descriptor, so a crashed creator leaves nothing
behind. Abstract sockets carry no file permissions, so the creator checks the caller's uid with
``SO_PEERCRED`` and refuses other users. Messages are fixed-layout ``struct`` records: no pickle.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable

from ringserve.shm.errors import PeerDiedError, RingError, RingTimeoutError

_HELLO = struct.Struct("<4sII")  # magic, requested role, attacher pid
_MAGIC = b"RSHM"
_ACK = b"ATTACHED"
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def _address(segment_name: str) -> str:
    return "\0ringserve-shm/" + segment_name


class AttachListener:
    """The creator's side of the handshake.

    Args:
        segment_name: the ring segment's name (the socket's address derives from it).
    """

    def __init__(self, segment_name: str) -> None:
        self._name = segment_name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.bind(_address(segment_name))
        self._sock.listen(64)

    def serve(self, roles: set[int], fds: list[int], deadline: float) -> None:
        """Accept attachers until every role in ``roles`` has attached.

        Args:
            roles: the roles still expected; each is removed as it attaches.
            fds: the eventfds to hand to each attacher.
            deadline: ``time.monotonic()`` value after which to give up.

        Raises:
            RingTimeoutError: some roles had not attached by the deadline.
        """
        while roles:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RingTimeoutError(
                    f"ring {self._name}: roles {sorted(roles)} did not attach in time"
                )
            self._sock.settimeout(remaining)
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                role = self._serve_one(conn, roles, fds)
            if role is not None:
                roles.discard(role)

    def _serve_one(self, conn: socket.socket, roles: set[int], fds: list[int]) -> int | None:
        cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        _, uid, _ = _PEERCRED.unpack(cred)
        if uid != os.getuid():
            return None  # another user: no descriptors for them
        try:
            hello = conn.recv(_HELLO.size)
            if len(hello) != _HELLO.size:
                return None
            magic, role, _pid = _HELLO.unpack(hello)
            if magic != _MAGIC or role not in roles:
                conn.send(b"NO")
                return None
            socket.send_fds(conn, [b"OK"], fds)
            ack = conn.recv(len(_ACK))
        except (TimeoutError, ConnectionError):
            return None  # the attacher died or stalled mid-handshake; it may retry
        return role if ack == _ACK else None

    def close(self) -> None:
        """Stop accepting (the abstract address disappears with the socket)."""
        self._sock.close()


def request_fds(
    segment_name: str, role: int, n_fds: int, timeout: float, before_ack: Callable[[], None]
) -> list[int]:
    """The attacher's side: ask the creator for the ring's eventfds.

    Args:
        segment_name: the ring segment's name.
        role: the role this process takes.
        n_fds: how many descriptors the ring has.
        timeout: seconds to wait for the creator to serve the request.
        before_ack: called with the descriptors received, before acknowledging (the attacher
            publishes its pid there, so the creator sees it once the handshake returns).

    Returns:
        The eventfds, non-inheritable, in role order.

    Raises:
        RingTimeoutError: the creator did not serve the request in time.
        PeerDiedError: the creator is gone or stopped accepting.
        RingError: the creator refused the role (already taken or unknown).
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(_address(segment_name))
            sock.send(_HELLO.pack(_MAGIC, role, os.getpid()))
            msg, fds, _, _ = socket.recv_fds(sock, 16, n_fds)
        except TimeoutError as exc:
            raise RingTimeoutError(f"ring {segment_name}: creator did not answer") from exc
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            raise PeerDiedError(
                f"ring {segment_name}: its creator is gone or no longer accepts peers"
            ) from exc
        if msg != b"OK" or len(fds) != n_fds:
            for fd in fds:
                os.close(fd)
            raise RingError(f"ring {segment_name}: creator refused role {role}")
        for fd in fds:
            os.set_inheritable(fd, False)
        before_ack()
        sock.send(_ACK)
    return fds
