"""The one wire codec: msgspec msgpack with out-of-band buffers for arrays, and no pickle.

Every cross-process message in ringserve is a `msgspec.Struct` encoded here. numpy arrays and
torch tensors are the only non-msgpack values allowed: each becomes a msgpack extension holding
(dtype, shape) and either its bytes inline (small arrays) or the index of an out-of-band buffer
that the transport sends as its own frame (zmq multipart, or a ring frame), so large arrays are
never copied into the msgpack body. Any other type is a `TypeError`: a peer that can write a
frame can describe data, never code.

Used by the engine core client and server sockets (frontend <-> core) and the executor rings
(core <-> workers). torch is imported only when a tensor is actually encoded or asked for.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

T = TypeVar("T")

# Arrays at or below this many bytes travel inside the msgpack body.
INLINE_MAX_BYTES = 256

_EXT_NDARRAY_INLINE = 1
_EXT_NDARRAY_OOB = 2
_EXT_TENSOR_INLINE = 3
_EXT_TENSOR_OOB = 4
_KNOWN_EXT_CODES = frozenset((_EXT_NDARRAY_INLINE, _EXT_NDARRAY_OOB, _EXT_TENSOR_INLINE, _EXT_TENSOR_OOB))

Buffer = bytes | bytearray | memoryview


class _ArrayHeader(msgspec.Struct, array_like=True):
    dtype: str
    shape: tuple[int, ...]
    index: int = -1
    data: bytes = b""


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_ArrayHeader)


def _torch_module() -> Any:
    return sys.modules.get("torch")


class MsgpackEncoder:
    """Encodes a message into a list of buffers: the msgpack body first, then OOB arrays.

    Not thread-safe: keep one encoder per sending thread.

    Args:
        inline_max_bytes: arrays up to this size are copied into the body.
    """

    def __init__(self, inline_max_bytes: int = INLINE_MAX_BYTES) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._inline_max = inline_max_bytes
        self._aux: list[Buffer] = []

    def encode(self, obj: Any) -> list[Buffer]:
        """Encode `obj`; returns [body, *out_of_band_buffers] (zero-copy views of arrays)."""
        self._aux = [b""]
        try:
            self._aux[0] = self._encoder.encode(obj)
            return self._aux
        finally:
            self._aux = []

    def encode_into(self, obj: Any, buf: bytearray) -> list[Buffer]:
        """Like `encode`, but writes the body into `buf` (reused between calls)."""
        self._aux = [buf]
        try:
            self._encoder.encode_into(obj, buf)
            return self._aux
        finally:
            self._aux = []

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self._encode_ndarray(obj, _EXT_NDARRAY_INLINE, obj.dtype.str)
        torch = _torch_module()
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._encode_tensor(obj, torch)
        raise TypeError(f"ringserve wire: cannot encode a value of type {type(obj).__qualname__}")

    def _encode_ndarray(self, arr: np.ndarray[Any, Any], inline_code: int, dtype: str) -> Any:
        if arr.dtype.hasobject:
            raise TypeError("ringserve wire: object arrays cannot be encoded")
        arr = np.ascontiguousarray(arr)
        shape = tuple(int(d) for d in arr.shape)
        if arr.nbytes <= self._inline_max:
            header = _ArrayHeader(dtype, shape, data=arr.tobytes())
            return msgspec.msgpack.Ext(inline_code, _header_encoder.encode(header))
        self._aux.append(arr.data.cast("B"))
        header = _ArrayHeader(dtype, shape, index=len(self._aux) - 1)
        return msgspec.msgpack.Ext(inline_code + 1, _header_encoder.encode(header))

    def _encode_tensor(self, tensor: Any, torch: Any) -> Any:
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        dtype = str(tensor.dtype).removeprefix("torch.")
        # Tensors go through numpy by their raw bytes, so dtypes numpy lacks (bfloat16) work.
        if tensor.numel():
            raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        else:
            raw = np.empty(0, np.uint8)
        return self._encode_ndarray_as(raw, tuple(tensor.shape), dtype)

    def _encode_ndarray_as(self, raw: np.ndarray[Any, Any], shape: tuple[int, ...], dtype: str) -> Any:
        if raw.nbytes <= self._inline_max:
            header = _ArrayHeader(dtype, shape, data=raw.tobytes())
            return msgspec.msgpack.Ext(_EXT_TENSOR_INLINE, _header_encoder.encode(header))
        self._aux.append(raw.data.cast("B"))
        header = _ArrayHeader(dtype, shape, index=len(self._aux) - 1)
        return msgspec.msgpack.Ext(_EXT_TENSOR_OOB, _header_encoder.encode(header))


class MsgpackDecoder(Generic[T]):
    """Decodes [body, *out_of_band_buffers] into a value of type `type_`.

    Arrays decoded from out-of-band buffers are views into those buffers (zero-copy): the
    caller must keep the buffers alive, and unchanged, while the arrays are in use.

    Args:
        type_: the expected type (a Struct, a tagged union, ...); validated on decode.
    """

    def __init__(self, type_: type[T]) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_, dec_hook=self._dec_hook, ext_hook=self._ext_hook)
        self._bufs: Sequence[Buffer] = ()

    def decode(self, bufs: Buffer | Sequence[Buffer]) -> T:
        """Decode one message from its body (and out-of-band buffers, if any).

        Raises:
            msgspec.DecodeError: the bytes are not msgpack, nest too deeply, or hold an array
                that numpy or torch cannot build (bad dtype, shape, size or buffer index).
            msgspec.ValidationError: the message does not match the type.
        """
        if isinstance(bufs, bytes | bytearray | memoryview):
            bufs = (bufs,)
        self._bufs = bufs
        try:
            return self._decoder.decode(bufs[0])
        except RecursionError:
            raise msgspec.DecodeError("ringserve wire: the message nests too deeply") from None
        finally:
            self._bufs = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        try:
            return self._decode_array(code, data)
        except msgspec.MsgspecError:
            raise
        except Exception as exc:
            # numpy and torch reject a bad header with ValueError, TypeError or RuntimeError;
            # callers catch one error type for "this frame is malformed".
            raise msgspec.DecodeError(f"ringserve wire: malformed array: {exc}") from exc

    def _decode_array(self, code: int, data: memoryview) -> Any:
        if code not in _KNOWN_EXT_CODES:
            raise msgspec.DecodeError(f"ringserve wire: unknown extension type {code}")
        header = _header_decoder.decode(data)
        if code in (_EXT_NDARRAY_INLINE, _EXT_TENSOR_INLINE):
            raw: Buffer = header.data
        else:
            if not 0 < header.index < len(self._bufs):
                raise msgspec.DecodeError(f"ringserve wire: missing out-of-band buffer {header.index}")
            raw = self._bufs[header.index]
        if code in (_EXT_NDARRAY_INLINE, _EXT_NDARRAY_OOB):
            dtype = np.dtype(header.dtype)
            if dtype.hasobject:
                raise msgspec.DecodeError("ringserve wire: object arrays cannot be decoded")
            return np.frombuffer(raw, dtype=dtype).reshape(header.shape)
        return _tensor_from_bytes(raw, header.dtype, header.shape)

    def _dec_hook(self, type_: type, obj: Any) -> Any:
        type_ = getattr(type_, "__origin__", type_)  # np.ndarray[Any, Any] -> np.ndarray
        if type_ is np.ndarray and isinstance(obj, np.ndarray):
            return obj
        torch = _torch_module()
        if torch is not None and type_ is torch.Tensor:
            if isinstance(obj, np.ndarray):
                return torch.from_numpy(obj.copy() if not obj.flags.writeable else obj)
            if isinstance(obj, torch.Tensor):
                return obj
        raise msgspec.ValidationError(f"expected {type_.__qualname__}, got {type(obj).__qualname__}")


def _tensor_from_bytes(raw: Buffer, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise msgspec.DecodeError(f"ringserve wire: unknown tensor dtype {dtype!r}")
    # Checked before anything is allocated: a bogus shape must not reserve memory.
    if min(shape, default=0) < 0 or math.prod(shape) * torch_dtype.itemsize != len(raw):
        raise msgspec.DecodeError(
            f"ringserve wire: {len(raw)} bytes do not hold a {dtype} tensor of shape {list(shape)}"
        )
    if len(raw) == 0:
        return torch.empty(shape, dtype=torch_dtype)
    view = memoryview(raw)
    if view.readonly:  # torch wants a writable buffer; read-only frames are copied once
        view = memoryview(bytearray(view))
    flat = torch.frombuffer(view, dtype=torch.uint8)
    return flat.view(torch_dtype).reshape(shape)
