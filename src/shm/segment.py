"""Shared-memory segment lifecycle: create, attach, unlink, stale cleanup.

Owns the files under ``/dev/shm`` that back the rings. ``ring.py`` creates one segment per ring
and attaches peers to it; the engine's start-up calls :func:`cleanup_stale` once.

Segments are plain files opened with ``os.open`` and mapped with ``mmap`` -- not
``multiprocessing.shared_memory`` -- so no ``resource_tracker`` process is involved and nothing
warns about "leaked" segments another process owns. A segment is created ``O_EXCL`` with mode
0600 under the name ``ringserve-<creator pid>-<random>-<label>``. Only the creator unlinks it,
exactly once: on :meth:`Segment.unlink` (``ring.py`` unlinks as soon as every peer has attached,
since mappings outlive the name), on :meth:`Segment.close`, and from an ``atexit`` hook for
interpreter exits that skipped both. A SIGKILLed creator cannot unlink; :func:`cleanup_stale`
removes segments whose creator pid is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import re
import secrets

from ringserve.shm.liveness import pid_alive

SHM_DIR = "/dev/shm"
PREFIX = "ringserve-"
_NAME_RE = re.compile(r"^ringserve-(\d+)-[0-9a-f]+-[A-Za-z0-9_]+$")
_LABEL_RE = re.compile(r"^[A-Za-z0-9_]{1,32}$")

# Paths this process created and has not unlinked yet; the atexit hook unlinks them.
_owned: set[str] = set()


def make_name(label: str) -> str:
    """A fresh segment name embedding this process's pid.

    Raises:
        ValueError: ``label`` is not 1-32 characters of ``[A-Za-z0-9_]``.
    """
    if not _LABEL_RE.match(label):
        raise ValueError(f"segment label must be 1-32 characters of [A-Za-z0-9_], got {label!r}")
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}-{label}"


def creator_pid(name: str) -> int | None:
    """The creator pid embedded in a segment name, or None if it is not a ring segment name."""
    match = _NAME_RE.match(name)
    return int(match.group(1)) if match else None


class Segment:
    """One mapped shared-memory segment.

    Attributes:
        name: the file name under ``/dev/shm``.
        size: the mapping's size in bytes.
        mapping: the ``mmap`` object.
        is_creator: whether this process created (and so must unlink) the segment.
    """

    def __init__(self, name: str, size: int, mapping: mmap.mmap, is_creator: bool) -> None:
        self.name = name
        self.size = size
        self.mapping = mapping
        self.is_creator = is_creator
        self._path = os.path.join(SHM_DIR, name)

    @classmethod
    def create(cls, label: str, size: int) -> Segment:
        """Create and map a new zero-filled segment (mode 0600, unique name)."""
        name = make_name(label)
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(path, flags, 0o600)
        _owned.add(path)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            _unlink_path(path)
            raise
        finally:
            os.close(fd)
        return cls(name, size, mapping, is_creator=True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment by name.

        Raises:
            FileNotFoundError: no such segment (never created, or already unlinked).
            ValueError: ``name`` is not a ring segment name.
        """
        if creator_pid(name) is None:
            raise ValueError(f"not a ringserve segment name: {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, size, mapping, is_creator=False)

    def unlink(self) -> None:
        """Remove the segment's name (creator only; idempotent, never unlinks twice)."""
        if self.is_creator and self._path in _owned:
            _unlink_path(self._path)

    def close(self) -> None:
        """Unmap (callers must have released their views first) and unlink if creator."""
        self.unlink()
        if not self.mapping.closed:
            self.mapping.close()


def _unlink_path(path: str) -> None:
    _owned.discard(path)
    # Already gone: a stale-cleanup pass by another run got there first.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@atexit.register
def _unlink_owned_at_exit() -> None:
    for path in list(_owned):
        _unlink_path(path)


def cleanup_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove ring segments (owned by this user) whose creator process is dead.

    Call once at start-up; safe to run while other live runs hold segments.

    Returns:
        The names removed.
    """
    removed: list[str] = []
    uid = os.getuid()
    for name in sorted(os.listdir(shm_dir)):
        pid = creator_pid(name)
        if pid is None or pid_alive(pid):
            continue
        path = os.path.join(shm_dir, name)
        try:
            if os.lstat(path).st_uid != uid:
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed
