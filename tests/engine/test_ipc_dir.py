"""The ipc socket directory: private (0700), named for its creator, and cleaned when stale."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from ringserve.engine.frontend.ipc_dir import cleanup_stale_ipc_dirs, creator_pid, make_ipc_dir


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_directory_is_private_and_names_its_creator() -> None:
    path = Path(make_ipc_dir())
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        assert creator_pid(path.name) == os.getpid()
    finally:
        shutil.rmtree(path)


def test_cleanup_removes_only_dirs_of_dead_creators(tmp_path: Path) -> None:
    dead = tmp_path / f"ringserve-zmq-{_dead_pid()}-abc_123"
    live = tmp_path / f"ringserve-zmq-{os.getpid()}-def456"
    foreign = tmp_path / "ringserve-zmq-notapid"
    other = tmp_path / "something-else"
    for path in (dead, live, foreign, other):
        path.mkdir()
    (dead / "input").write_bytes(b"")  # a socket file left behind
    assert cleanup_stale_ipc_dirs(str(tmp_path)) == [dead.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (live, foreign, other))
