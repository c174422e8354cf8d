"""What a trainer sends: named tensors and their metadata (the trainer side of a weight update).

A :class:`WeightSource` says which tensors a round carries (:meth:`~WeightSource.metadata`,
cheap: names, dtypes and shapes, nothing materialised) and yields them one at a time
(``__iter__``, re-iterable, in the metadata's order). :class:`ModuleWeightSource` wraps a
``torch.nn.Module``'s parameters, :class:`StateDictSource` a mapping of tensors; a trainer's
own source may describe its tensors with any record of ``name``, ``shape`` and ``dtype``
(vLLM's ``ParamMeta``, a named tuple, a dict), which :func:`tensor_metas` reads into
`TensorMeta`. The `TrainerWeightTransferEngine` packs what a source yields into buckets;
`metadata_dict` is the ``start_weight_update`` body the engine checks against its model.

Dtype names are torch's without the ``torch.`` prefix ("float32", "bfloat16", ...): the
spelling vLLM's weight-transfer metadata uses.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import msgspec
import torch

# The dtypes a weight may travel as: every one is a plain fixed-size element type that a byte
# buffer can be viewed as.
_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called `name` ("float32", "bfloat16", ...).

    Raises:
        ValueError: not one of the dtypes a weight may travel as (the message lists them).
    """
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(_DTYPES)}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of `dtype` (``torch.bfloat16`` -> "bfloat16").

    Raises:
        ValueError: a dtype weights cannot travel as (complex, quantized, ...).
    """
    name = _NAMES.get(dtype)
    if name is None:
        raise ValueError(f"weights of dtype {dtype} cannot be sent; allowed: {', '.join(_DTYPES)}")
    return name


class TensorMeta(msgspec.Struct, frozen=True):
    """One tensor of a round: its name (the engine's checkpoint name), dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * dtype_from_name(self.dtype).itemsize


def tensor_meta(name: str, tensor: torch.Tensor) -> TensorMeta:
    """The metadata of `tensor` sent as `name`."""
    return TensorMeta(name, dtype_name(tensor.dtype), tuple(int(d) for d in tensor.shape))


class TensorRecord(Protocol):
    """What a source's `metadata` may describe a tensor with: `TensorMeta`, vLLM's
    ``ParamMeta``, a named tuple or dataclass of these three fields. ``dtype`` is a
    ``torch.dtype`` or its name ("bfloat16", "torch.bfloat16")."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> Iterable[int]: ...

    @property
    def dtype(self) -> torch.dtype | str: ...


@runtime_checkable
class WeightSource(Protocol):
    """Named tensors for a trainer to send."""

    def metadata(self) -> Iterable[TensorRecord | Mapping[str, Any]]:
        """Every tensor a round sends, in iteration order; cheap, materialises nothing.
        Each entry has a ``name``, a ``shape`` and a ``dtype`` (see `TensorRecord`; a dict
        with those keys also does)."""
        ...

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors, one at a time, in `metadata`'s order; may be iterated again."""
        ...


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


class ModuleWeightSource:
    """A module's parameters (``named_parameters()``; buffers are not sent), detached and on
    the CPU (copied there only when they live elsewhere).

    Args:
        module: the trainer's model.
        names: maps a parameter name to the name the engine expects, or to None to leave the
            parameter out (e.g. strip a wrapper's ``"_orig_mod."`` prefix, skip a value head).
    """

    def __init__(self, module: torch.nn.Module, *,
                 names: Callable[[str], str | None] | None = None) -> None:
        self.module = module
        self._names = names

    def _named(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.module.named_parameters():
            sent = name if self._names is None else self._names(name)
            if sent is not None:
                yield sent, param

    def metadata(self) -> list[TensorMeta]:
        """Names, dtypes and shapes of the parameters sent."""
        return [tensor_meta(name, param) for name, param in self._named()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._named():
            yield name, _to_cpu(param)


class StateDictSource:
    """A mapping of name -> tensor (a state dict), detached and on the CPU, in the mapping's
    order."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def metadata(self) -> list[TensorMeta]:
        """Names, dtypes and shapes of the tensors."""
        return [tensor_meta(name, tensor) for name, tensor in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.tensors.items():
            yield name, _to_cpu(tensor)


_FIELDS = ("name", "shape", "dtype")


def _field(record: object, field: str, label: str) -> Any:
    if isinstance(record, Mapping):
        if field in record:
            return record[field]
    elif hasattr(record, field):
        return getattr(record, field)
    raise TypeError(f"{label} ({type(record).__name__}) has no {field!r}: each entry needs "
                    f"{', '.join(_FIELDS)}")


def _record_dtype(value: object, label: str) -> str:
    if isinstance(value, torch.dtype):
        name = _NAMES.get(value)
    elif isinstance(value, str):
        # str(torch.bfloat16) is "torch.bfloat16": the spelling a trainer most often has.
        name = value.removeprefix("torch.") if value.removeprefix("torch.") in _DTYPES else None
    else:
        raise TypeError(f"{label}.dtype must be a torch.dtype or its name such as "
                        f"'bfloat16', got {type(value).__name__} {value!r}")
    if name is None:
        raise TypeError(f"{label}.dtype {value!r} cannot be sent; allowed: "
                        f"{', '.join(_DTYPES)}")
    return name


def _record_shape(value: object, label: str) -> tuple[int, ...]:
    # A string is iterable but never a shape; bools are ints to Python but not to a shape.
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(f"{label}.shape must be a sequence of ints (a torch.Size, tuple or "
                        f"list), got {type(value).__name__} {value!r}")
    dims: list[int] = []
    for dim in value:
        try:
            if isinstance(dim, bool):
                raise TypeError
            size = operator.index(dim)
        except TypeError:
            raise TypeError(f"{label}.shape {value!r}: dimension {dim!r} is not an int") from None
        if size < 0:
            raise TypeError(f"{label}.shape {value!r}: dimension {size} is negative")
        dims.append(size)
    return tuple(dims)


def tensor_metas(records: object) -> list[TensorMeta]:
    """A source's `metadata()` as `TensorMeta` (checked, in order).

    Args:
        records: an iterable of `TensorRecord` (vLLM's ``ParamMeta``, a named tuple, a
            dataclass, `TensorMeta`) or of dicts with the keys ``name``, ``shape`` and
            ``dtype``.

    Raises:
        TypeError: `records` is not iterable, or an entry lacks a field or has a bad one;
            the message names the entry (``metadata()[3] ('lm_head.weight')``) and the
            field.
    """
    if isinstance(records, str | bytes | Mapping) or not isinstance(records, Iterable):
        raise TypeError(f"metadata() must return a list of records with {', '.join(_FIELDS)}, "
                        f"got {type(records).__name__}")
    metas: list[TensorMeta] = []
    for index, record in enumerate(records):
        label = f"metadata()[{index}]"
        name = _field(record, "name", label)
        if not isinstance(name, str):
            raise TypeError(f"{label}.name must be a str, got {type(name).__name__} {name!r}")
        label = f"{label} ({name!r})"
        shape = _record_shape(_field(record, "shape", label), label)
        dtype = _record_dtype(_field(record, "dtype", label), label)
        metas.append(TensorMeta(name, dtype, shape))
    return metas


def metadata_dict(metas: list[TensorMeta]) -> dict[str, Any]:
    """The ``start_weight_update`` metadata: ``{"names": [...], "dtype_names": [...],
    "shapes": [[...], ...]}``."""
    return {
        "names": [meta.name for meta in metas],
        "dtype_names": [meta.dtype for meta in metas],
        "shapes": [list(meta.shape) for meta in metas],
    }
