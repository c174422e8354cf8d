"""The private directory that holds a frontend's zmq ipc socket files, and its stale cleanup.

A multiprocess client (`mp_client.SyncMPClient`, `async_client.AsyncMPClient`) binds its ROUTER
and PULL sockets on `ipc://` paths inside one directory made by `make_ipc_dir`: mode 0700 (only
this user can connect), named `ringserve-zmq-<creator pid>-<random>` under the system temporary
directory. The engine cores only connect, so they create no socket files of their own. The
client removes the directory on shutdown; a SIGKILLed frontend cannot, and the next server start
calls `cleanup_stale_ipc_dirs`, which removes this user's directories whose creator is dead.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from ringserve.shm.liveness import pid_alive

PREFIX = "ringserve-zmq-"
_NAME_RE = re.compile(r"^ringserve-zmq-(\d+)-[A-Za-z0-9_]+$")


def make_ipc_dir() -> str:
    """Create a fresh private (0700) directory for ipc sockets; returns its path."""
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def creator_pid(name: str) -> int | None:
    """The creator pid embedded in an ipc directory name (None: not one of ours)."""
    match = _NAME_RE.match(name)
    return int(match.group(1)) if match else None


def cleanup_stale_ipc_dirs(tmp_dir: str | None = None) -> list[str]:
    """Remove ipc directories (owned by this user) whose creator process is dead.

    Safe while other live runs hold directories of their own.

    Args:
        tmp_dir: where to look (default: the system temporary directory).

    Returns:
        The names removed.
    """
    root = tmp_dir if tmp_dir is not None else tempfile.gettempdir()
    removed: list[str] = []
    uid = os.getuid()
    for name in sorted(os.listdir(root)):
        pid = creator_pid(name)
        if pid is None or pid_alive(pid):
            continue
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid != uid or not os.path.isdir(path):
                continue
        except FileNotFoundError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed
