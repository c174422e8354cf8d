"""Where the weight snapshots live (`ringserve.gpu.weights.snapshot`), and their cleanup.

Directories live under `RINGSERVE_HOME/weight_snapshots/core-<pid>-<engine index>`, each with
two slots `a/` and `b/` and a symlink `current` to the last complete one; the core removes its
own at shutdown, and `cleanup_stale` removes those of cores that are gone. Apart from the
writer because the engine core needs only these paths, and importing the writer imports torch.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

from ringserve import envs
from ringserve.shm.liveness import pid_alive

SNAPSHOT_FILE = "model.safetensors"
CURRENT = "current"  # symlink to the slot holding the last complete round
SLOTS = ("a", "b")
_DIR_RE = re.compile(r"^core-(\d+)-\d+$")


def snapshot_root() -> Path:
    """Where every core's snapshot directory lives."""
    return envs.ringserve_home() / "weight_snapshots"


def snapshot_dir(engine_index: int) -> Path:
    """This process's (an engine core's) snapshot directory for `engine_index`."""
    return snapshot_root() / f"core-{os.getpid()}-{engine_index}"


def current_snapshot(engine_index: int) -> Path:
    """The directory (a symlink to a slot) a restart of this core loads the weights from."""
    return snapshot_dir(engine_index) / CURRENT


def cleanup_stale() -> list[str]:
    """Remove the snapshot directories of engine cores that no longer run; their names."""
    removed: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in snapshot_root().iterdir():
            match = _DIR_RE.match(entry.name)
            if match and not pid_alive(int(match.group(1))):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
    return removed


def remove(directory: Path) -> None:
    """Remove a snapshot directory (idempotent)."""
    shutil.rmtree(directory, ignore_errors=True)
