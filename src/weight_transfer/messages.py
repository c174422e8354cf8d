"""The transports' wire schema: what ``init_weight_transfer_engine`` and ``update_weights``
carry from the trainer to every engine worker, per backend.

The trainer (`TrainerWeightTransferEngine`) builds these and sends them as plain JSON objects
(``msgspec.to_builtins``); each worker's receiver (`make_receiver`, `WeightReceiver.receive`)
decodes and checks them here before it touches a byte. Unknown fields are refused.

shm::

    init_info   = {"segments": ["ringserve-<pid>-<hex>-wt_a", ...]}
    update_info = {"segment": "ringserve-<pid>-<hex>-wt_a",
                   "tensors": [{"name": str, "dtype": "bfloat16", "shape": [n, k],
                                "offset": int}, ...]}

gloo / nccl::

    init_info   = {"master_address": str, "master_port": int, "world_size": int}
    update_info = {"nbytes": int,
                   "tensors": [{"name": str, "dtype": str, "shape": [...], "offset": int}, ...]}

``offset`` is the tensor's first byte in the segment (shm) or in the bucket's packed buffer
(gloo / nccl), a multiple of 64; the tensor's bytes (C order) must lie inside it. ``world_size``
is the trainer (rank 0) plus every receiving engine worker (ranks 1..N).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class TensorSlot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one tensor lies in a bucket."""

    name: str
    dtype: str
    shape: tuple[NonNegative, ...]
    offset: NonNegative


class ShmInitInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The trainer's bucket segments (every worker attaches each once)."""

    segments: list[str]


class ShmUpdateInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One bucket: the segment it fills and its tensors."""

    segment: str
    tensors: list[TensorSlot]


class CollectiveInitInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The trainer's TCPStore and the group's size (trainer + receiving workers)."""

    master_address: str
    master_port: Port
    world_size: Annotated[int, msgspec.Meta(ge=2)]


class CollectiveUpdateInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One bucket: the byte count of the packed buffer rank 0 broadcasts, and its tensors."""

    nbytes: NonNegative
    tensors: list[TensorSlot]


class CollectiveTrainerOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a trainer may pass as `trainer_init`'s ``init_info`` for gloo / nccl.

    Attributes:
        master_address: the address the engine's workers reach the trainer at (its TCPStore
            and rank 0); loopback by default, so another host must be given explicitly.
        master_port: the TCPStore's port; 0 picks a free one.
        world_size: trainer + receiving workers; by default the client's
            ``get_world_size() + 1``.
    """

    master_address: str = "127.0.0.1"
    master_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    world_size: Annotated[int, msgspec.Meta(ge=2)] | None = None


_T = TypeVar("_T", bound=msgspec.Struct)

_SCHEMAS: dict[type[msgspec.Struct], str] = {
    ShmInitInfo: '{"segments": ["ringserve-...", ...]}',
    ShmUpdateInfo: '{"segment": "ringserve-...", "tensors": [{"name", "dtype", "shape", '
                   '"offset"}, ...]}',
    CollectiveInitInfo: '{"master_address": str, "master_port": int, "world_size": int}',
    CollectiveUpdateInfo: '{"nbytes": int, "tensors": [{"name", "dtype", "shape", "offset"}, '
                          '...]}',
    CollectiveTrainerOptions: '{"master_address": str, "master_port": int, "world_size": int} '
                              '(each optional)',
}


def decode(kind: type[_T], value: Any, what: str, backend: str) -> _T:
    """`value` (a JSON object) as a `kind`.

    Raises:
        ValueError: not an object, a missing or unknown field, or a wrong type; the message
            names the path (``at `$.tensors[0].offset```) and the expected schema.
    """
    if not isinstance(value, dict):
        raise ValueError(f"{what} for the {backend} backend: expected a JSON object "
                         f"{_SCHEMAS[kind]}, got {type(value).__name__}")
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{what} for the {backend} backend: {exc}; expected "
                         f"{_SCHEMAS[kind]}") from None


def encode(message: msgspec.Struct) -> dict[str, Any]:
    """`message` as a plain JSON object (lists, not tuples: what it is after a JSON trip)."""
    value: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(message))
    return value
