"""Safetensors checkpoints: which files a directory holds, their checked headers, and a reader
that streams tensors one at a time without mapping the files.

`ModelConfig.from_model_dir` calls `checkpoint_files` and `check_headers` in the frontend, so a
missing shard, a truncated file or an unsupported dtype fails with one line before any process
starts. The worker's loader (`ringserve.gpu.weights.loader`) streams tensors through `TensorReader`:
each tensor is read with `readinto` into a buffer of its own, not through `mmap`, because
mapped pages count towards the process's resident memory until the file is closed (a 1 GB shard
would sit in RSS next to the model it was copied into); read this way, peak memory is the model
plus one tensor. Pickled checkpoints (`pytorch_model.bin`, `*.pt`) are refused: loading one runs
code from the file.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ringserve.errors import ModelDirectoryError

INDEX_FILE = "model.safetensors.index.json"

DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_PICKLES = ("pytorch_model.bin", "*.bin", "*.pt", "*.pth")
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: name, dtype code, shape and byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory (from the shard index when there is one).

    Raises:
        ModelDirectoryError: no safetensors weights (a pickled checkpoint is named, with how
            to convert it), an unreadable index, or an index naming a missing shard.
    """
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelDirectoryError(f"{index}: unreadable shard index ({exc})") from None
        files = [model_dir / str(name) for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelDirectoryError(f"{index} names missing shards: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted({p.name for pattern in _PICKLES for p in model_dir.glob(pattern)})
    if pickles:
        raise ModelDirectoryError(
            f"model directory {model_dir}: only pickled weights ({', '.join(pickles)}); "
            "ringserve loads safetensors only, because loading a pickle runs code from the "
            "file. Convert once with transformers: AutoModelForCausalLM.from_pretrained(DIR)"
            ".save_pretrained(DIR, safe_serialization=True)"
        )
    raise ModelDirectoryError(f"model directory {model_dir}: no *.safetensors weights "
                              f"(model.safetensors, or shards with {INDEX_FILE})")


def read_header(path: Path) -> list[TensorEntry]:
    """The tensors of one safetensors file, checked against the file's size.

    Raises:
        ModelDirectoryError: unreadable, truncated, or not a safetensors file.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelDirectoryError(f"{path}: truncated ({size} bytes): not a safetensors file")
            (length,) = struct.unpack("<Q", raw)
            if length > min(_MAX_HEADER, size - 8):
                raise ModelDirectoryError(f"{path}: truncated or not a safetensors file "
                                          f"(header of {length} bytes in a {size}-byte file)")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise ModelDirectoryError(f"{path}: unreadable: {exc}") from None
    except ValueError as exc:
        raise ModelDirectoryError(f"{path}: not a safetensors file ({exc})") from None
    base = 8 + length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(x) for x in info["data_offsets"])
            entry = TensorEntry(name, str(info["dtype"]), tuple(int(d) for d in info["shape"]),
                                base + start, base + end)
        except (KeyError, TypeError, ValueError):
            raise ModelDirectoryError(f"{path}: malformed header entry for {name!r}") from None
        entries.append(entry)
    data_end = max((e.end for e in entries), default=base)
    if data_end > size:
        raise ModelDirectoryError(f"{path}: truncated: its header needs {data_end} bytes, the "
                                  f"file has {size}")
    return entries


def is_index_buffer(entry: TensorEntry) -> bool:
    """An integer buffer some checkpoints save beside their weights (BERT's
    `embeddings.position_ids`): the model rebuilds it, so it is skipped, not refused."""
    return entry.dtype in ("I64", "I32") and entry.name.endswith(
        ("position_ids", "token_type_ids"))


def check_headers(files: list[Path]) -> dict[Path, list[TensorEntry]]:
    """Read and check every file's header (cheap: no tensor data is read).

    Raises:
        ModelDirectoryError: a truncated file, or a tensor whose dtype is not a float type
            (e.g. FP8 or integer-packed quantized weights, which this engine does not run).
    """
    headers = {}
    for path in files:
        entries = read_header(path)
        for entry in entries:
            if entry.dtype not in FLOAT_DTYPES and not is_index_buffer(entry):
                raise ModelDirectoryError(
                    f"{path}: tensor {entry.name!r} has dtype {entry.dtype}; supported: "
                    f"{', '.join(FLOAT_DTYPES)} (quantized checkpoints are not supported)"
                )
        headers[path] = entries
    return headers


def read_named_tensor(files: list[Path], name: str) -> torch.Tensor | None:
    """One tensor of a checkpoint by its name (None: no file has it), read alone."""
    for path in files:
        for entry in read_header(path):
            if entry.name == name:
                with io.FileIO(path, "r") as f:
                    return _read_tensor(f, path, entry)
    return None


class TensorReader:
    """Streams (name, tensor) from safetensors files, one tensor in memory at a time.

    With `reuse_buffer`, every tensor is read into one staging buffer (sized to the largest
    tensor), so a yielded tensor is valid only until the next one is read: the loader copies
    each into its parameter at once. This saves a page fault per 4 KiB of every tensor (a
    fresh buffer per tensor faulted in 1 GB of pages for a 1 GB checkpoint: ~2 s here).

    `current_file` names the file of the tensor last yielded, so the loader can say where a
    tensor that does not fit the model came from.
    """

    def __init__(self, files: list[Path], *, reuse_buffer: bool = False) -> None:
        self.files = files
        self.reuse_buffer = reuse_buffer
        self.current_file: Path | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        staging: torch.Tensor | None = None
        for path in self.files:
            self.current_file = path
            entries = read_header(path)
            if self.reuse_buffer:
                need = max((e.end - e.start for e in entries), default=0)
                if staging is None or staging.numel() < need:
                    staging = torch.empty(need, dtype=torch.uint8)
            with io.FileIO(path, "r") as f:
                for entry in sorted(entries, key=lambda e: e.start):
                    if not is_index_buffer(entry):
                        yield entry.name, _read_tensor(f, path, entry, staging)

    def describe(self) -> str:
        """Where the reader is, for error messages."""
        return str(self.current_file) if self.current_file is not None else "checkpoint"


def _read_tensor(f: io.FileIO, path: Path, entry: TensorEntry,
                 staging: torch.Tensor | None = None) -> torch.Tensor:
    dtype = DTYPES.get(entry.dtype)
    if dtype is None:
        raise ModelDirectoryError(f"{path}: tensor {entry.name!r} has unsupported dtype "
                                  f"{entry.dtype}")
    numel = 1
    for d in entry.shape:
        numel *= d
    nbytes = entry.end - entry.start
    if staging is not None and nbytes % dtype.itemsize == 0:
        tensor = staging[:nbytes].view(dtype)
    else:
        tensor = torch.empty(numel, dtype=dtype)
    if nbytes != numel * tensor.element_size():
        raise ModelDirectoryError(f"{path}: tensor {entry.name!r}: {nbytes} bytes for shape "
                                  f"{list(entry.shape)} {entry.dtype}")
    view = tensor.view(torch.uint8).numpy().data
    f.seek(entry.start)
    got = 0
    while got < nbytes:
        n = f.readinto(view[got:])
        if not n:
            raise ModelDirectoryError(f"{path}: truncated inside tensor {entry.name!r}")
        got += n
    return tensor.view(entry.shape)
