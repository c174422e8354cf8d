"""The last complete weights from a trainer, kept on disk so that new workers can load them.

A weight update replaces the weights the engine started with; a worker that dies and is
restarted (`retry` after a fault) or a wake-up from sleep level 2 would otherwise load the
start-up checkpoint again. So TP rank 0 of each engine core writes every tensor of a round, as
it arrives and in the trainer's names and dtypes, into a safetensors file (`SnapshotWriter`).
There are two slots, `a/` and `b/`, written alternately in place (rewriting pages the page
cache already holds runs at ~4.5 GB/s here; a fresh file's first write at ~0.7 GB/s), and a
symlink `current` that is switched atomically to the slot a round filled once that round has
been swapped in: `current` always holds the last complete round. The core points restarts and
wake-ups at it (`ringserve.engine.core.weight_sync`), read by the ordinary start-up loader.

A snapshot needs the round's metadata up front (the file's header is written first); a round
started without metadata (a plain vLLM client) has none, and a restart then loads the start-up
weights (the core says so). Cost: one write of the round's bytes into the page cache.

Directories live under `RINGSERVE_HOME/weight_snapshots/core-<pid>-<engine index>`; the core
removes its own at shutdown, and `cleanup_stale` removes those of cores that are gone.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from ringserve.gpu.weights.snapshot_dirs import CURRENT, SLOTS, SNAPSHOT_FILE

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                       torch.float64: "F64"}


class SnapshotWriter:
    """One round's tensors written into a safetensors file at their final offsets.

    Args:
        directory: the core's snapshot directory (created when missing).
        tensors: (name, dtype, shape) of every tensor of the round, as the metadata says.

    Raises:
        ValueError: a dtype safetensors has no name for here (only float dtypes are
            weights), or a name given twice.
    """

    def __init__(self, directory: Path, tensors: list[tuple[str, torch.dtype, list[int]]]) -> None:
        self.directory = directory
        current = os.path.basename(os.readlink(directory / CURRENT)) if (
            directory / CURRENT).is_symlink() else None
        self._slot = SLOTS[1] if current == SLOTS[0] else SLOTS[0]
        self._offsets: dict[str, tuple[int, int]] = {}
        header: dict[str, object] = {}
        offset = 0
        for name, dtype, shape in tensors:
            if dtype not in _SAFETENSORS_DTYPES:
                raise ValueError(f"weight snapshot: tensor {name!r} has dtype {dtype}")
            if name in header:
                raise ValueError(f"weight snapshot: tensor {name!r} is listed twice")
            nbytes = dtype.itemsize
            for dim in shape:
                nbytes *= dim
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": shape,
                            "data_offsets": [offset, offset + nbytes]}
            self._offsets[name] = (offset, nbytes)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self._base = 8 + len(raw)
        (directory / self._slot).mkdir(parents=True, exist_ok=True)
        self._path = directory / self._slot / SNAPSHOT_FILE
        # Not truncated: a slot of the same size keeps its pages (the fast rewrite).
        self._fd: int | None = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self._fd, self._base + offset)
        os.pwrite(self._fd, len(raw).to_bytes(8, "little") + raw, 0)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Store one received tensor (a name the metadata did not list is ignored: the
        loader refuses it on its own)."""
        place = self._offsets.get(name)
        if place is None or self._fd is None:
            return
        offset, nbytes = place
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if data.numel() != nbytes:
            return  # the loader refuses the shape; the round fails before it commits
        view = memoryview(data.numpy().data)
        written = 0
        while written < nbytes:
            written += os.pwrite(self._fd, view[written:], self._base + offset + written)

    def commit(self) -> Path:
        """The round is swapped in: point `current` at its slot. Returns `current`."""
        self._close()
        link = self.directory / f".{CURRENT}-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        os.symlink(self._slot, link)
        os.replace(link, self.directory / CURRENT)
        return self.directory / CURRENT

    def discard(self) -> None:
        """The round failed: its slot is not current, and is simply rewritten next time."""
        self._close()

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
