"""The header of a GGUF file: its metadata key/values and its tensors' names, types and places.

GGUF (llama.cpp's format, versions 2 and 3, little-endian): magic "GGUF", a version, the tensor
and key/value counts, the key/values (typed scalars, strings and arrays), one record per tensor
(name, dims innermost first, ggml type, offset into the data section), then the data section at
the next multiple of `general.alignment`. gguf-py's `GGUFReader` builds a numpy view per array
element, which takes tens of seconds for a 150k-token vocabulary and its merges; this reader
walks the header once with `struct` over a read-only map of the file (only the header's pages
are touched) and keeps numeric arrays as numpy arrays and string arrays as lists. Used by
`ringserve.checkpoint.gguf_file`, `gguf_config` and `gguf_weights`.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringserve.errors import ModelDirectoryError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value type -> struct format (scalars) or numpy dtype (array items)
_SCALARS: dict[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f",
                            7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY: dict[int, str] = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
                          7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a GGUF file.

    Attributes:
        name: the llama.cpp name ("blk.0.attn_q.weight").
        shape: the row-major (PyTorch) shape: the file's dims, outermost first.
        ggml_type: the `gguf.GGMLQuantizationType` value.
        offset: the absolute byte offset of its data in the file.
        n_bytes: its size in the file (None for a type gguf-py does not know).
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    n_bytes: int | None

    @property
    def type_name(self) -> str:
        """The ggml type's name ("Q8_0"), or "type N" for an unknown one."""
        import gguf

        try:
            return str(gguf.GGMLQuantizationType(self.ggml_type).name)
        except ValueError:
            return f"type {self.ggml_type}"


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """A GGUF file's version, metadata (key -> value) and tensors, in file order."""

    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        end = self.pos + size
        if end > len(self.data):
            raise struct.error("string past the end of the file")
        text = self.data[self.pos:end].decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item not in _NUMPY:
                raise ValueError(f"array of unknown value type {item}")
            dtype = np.dtype(_NUMPY[item])
            array = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += dtype.itemsize * count
            return array
        if kind not in _SCALARS:
            raise ValueError(f"unknown value type {kind}")
        return self.unpack(_SCALARS[kind])


def read_header(path: Path) -> GGUFHeader:
    """Parse the header of GGUF file `path`.

    Raises:
        ModelDirectoryError: the file is missing, not GGUF, of an unsupported version, or ends
            (or is corrupt) inside the header.
    """
    if not path.is_file():
        raise ModelDirectoryError(f"GGUF file {path} does not exist")
    with path.open("rb") as f:
        if f.read(4) != MAGIC:
            raise ModelDirectoryError(f"{path} is not a GGUF file (its first bytes are not 'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                return _parse(path, _Cursor(data))
            except (struct.error, ValueError, OverflowError, MemoryError) as exc:
                raise ModelDirectoryError(
                    f"GGUF file {path} is truncated or corrupt in its header: {exc}"
                ) from exc


def _parse(path: Path, cur: _Cursor) -> GGUFHeader:
    import gguf

    cur.pos = 4
    version = cur.unpack("<I")
    if version not in VERSIONS:
        raise ModelDirectoryError(
            f"GGUF file {path}: version {version} is not supported; supported: 2, 3"
            + (" (a big-endian file?)" if version > 0xFFFF else "")
        )
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    records = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        records.append((name, tuple(reversed(dims)), cur.unpack("<I"), cur.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ModelDirectoryError(f"GGUF file {path}: general.alignment {alignment} is not a power of two")
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, shape, kind, offset in records:
        sizes = gguf.GGML_QUANT_SIZES.get(_known_type(kind))
        n_bytes = None if sizes is None else math.prod(shape) // sizes[0] * sizes[1]
        tensors.append(TensorInfo(name, shape, kind, start + offset, n_bytes))
    return GGUFHeader(version, metadata, tuple(tensors))


def _known_type(kind: int) -> Any:
    import gguf

    try:
        return gguf.GGMLQuantizationType(kind)
    except ValueError:
        return None
