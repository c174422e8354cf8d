"""Helpers shared by the ring tests (a unique module name: tests dirs have no __init__.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from ringserve.shm import RingReader, RingWriter

PEER = str(Path(__file__).with_name("shm_peer.py"))


class Peers:
    """Starts ``shm_peer.py`` child processes and makes sure none outlives the test."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *args: object) -> subprocess.Popen[str]:
        cmd = [sys.executable, PEER, *map(str, args)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def finish(self, proc: subprocess.Popen[str], timeout: float = 60.0) -> str:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"peer failed ({proc.returncode}):\n{out}\n{err}"
        return out


def attach_in_thread(writer: RingWriter, n_readers: int = 1, **kw: object) -> list[RingReader]:
    """Attach ``n_readers`` readers to ``writer`` from threads of this process."""
    readers: list[RingReader | None] = [None] * n_readers

    def attach(i: int) -> None:
        readers[i] = RingReader.attach(writer.name, i, **kw)  # type: ignore[arg-type]

    threads = [threading.Thread(target=attach, args=(i,)) for i in range(n_readers)]
    for t in threads:
        t.start()
    writer.wait_attached(10.0)
    for t in threads:
        t.join()
    return [r for r in readers if r is not None]
