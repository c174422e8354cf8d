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

    init_info   = {"master_address": str, "master_port": int, "rank_offset": int,
                   "world_size": int}
    update_info = {"nbytes": int,
                   "tensors": [{"name": str, "dtype": str, "shape": [...], "offset": int}, ...]}

``offset`` is the tensor's first byte in the segment (shm) or in the bucket's packed buffer
(gloo / nccl), a multiple of 64; the tensor's bytes (C order) must lie inside it. The group's
ranks are vLLM's (its ``NCCLWeightTransferInitInfo``): the trainer's come first (rank 0
broadcasts), the engine worker with index ``i`` (``engine_index * tp_size + tp_rank``) is rank
``rank_offset + i`` (``rank_offset`` optional, default 1: one trainer rank), and
``world_size`` counts both, ``rank_offset + N`` for N receiving workers.

vLLM's own spellings are read where they mean the same: an object wrapped as
``{"init_info": {...}}`` / ``{"update_info": {...}}`` (the argument of vLLM's
``LLM.init_weight_transfer_engine`` / ``update_weights``) is unwrapped. vLLM's per-tensor
``update_info`` (``names``, ``dtype_names``, ``shapes``, ``packed``, CUDA IPC handles, ...)
describes another byte stream (one broadcast per tensor, vLLM's own packing, or IPC handles)
and is refused with a message that says so.
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
    """The trainer's TCPStore, the first worker's rank and the group's size (the trainer's
    ranks + the receiving workers)."""

    master_address: str
    master_port: Port
    world_size: Annotated[int, msgspec.Meta(ge=2)]
    # Rank 0 is the trainer that broadcasts, so no worker may take it.
    rank_offset: Annotated[int, msgspec.Meta(ge=1)] = 1


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
        rank_offset: the engine workers' first rank, as vLLM's trainer scripts send it;
            the only value a `TrainerWeightTransferEngine` serves is 1 (it is the group's
            one trainer rank).
        rank: this trainer process's rank (vLLM's ``TrainerInitInfo.rank``); only the
            sender, rank 0, runs a `TrainerWeightTransferEngine`.
    """

    master_address: str = "127.0.0.1"
    master_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    world_size: Annotated[int, msgspec.Meta(ge=2)] | None = None
    rank_offset: int = 1
    rank: int = 0


class ShmTrainerOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a trainer may pass as `trainer_init`'s ``init_info`` for shm: nothing but vLLM's
    ``rank`` (only the sender, rank 0, runs a `TrainerWeightTransferEngine`)."""

    rank: int = 0


_T = TypeVar("_T", bound=msgspec.Struct)

_SCHEMAS: dict[type[msgspec.Struct], str] = {
    ShmInitInfo: '{"segments": ["ringserve-...", ...]}',
    ShmUpdateInfo: '{"segment": "ringserve-...", "tensors": [{"name", "dtype", "shape", '
                   '"offset"}, ...]}',
    CollectiveInitInfo: '{"master_address": str, "master_port": int, "rank_offset": int >= 1 '
                        '(optional, default 1), "world_size": int}',
    CollectiveUpdateInfo: '{"nbytes": int, "tensors": [{"name", "dtype", "shape", "offset"}, '
                          '...]}',
    CollectiveTrainerOptions: '{"master_address": str, "master_port": int, "world_size": int, '
                              '"rank_offset": 1, "rank": 0} (each optional)',
    ShmTrainerOptions: '{}: the trainer takes none (vLLM\'s {"rank": 0} is read too)',
}

# vLLM's per-tensor update_info fields (its NCCL and CUDA IPC backends): none is ringserve's.
_VLLM_UPDATE_FIELDS = ("names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes",
                       "packed_num_buffers", "ipc_handles", "ipc_handles_pickled")
_UPDATE_KINDS: tuple[type[msgspec.Struct], ...] = (ShmUpdateInfo, CollectiveUpdateInfo)


def decode(kind: type[_T], value: Any, what: str, backend: str) -> _T:
    """`value` (a JSON object) as a `kind`.

    `value` may also come wrapped as vLLM's request, ``{what: {...}}``.

    Raises:
        ValueError: not an object, a missing or unknown field, or a wrong type; the message
            names the path (``at `$.tensors[0].offset```) and the expected schema. vLLM's
            per-tensor ``update_info`` is refused naming its fields.
    """
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get(what), dict):
        value = value[what]  # vLLM's request wrapper ({"init_info": {...}}): the same object
    if not isinstance(value, dict):
        raise ValueError(f"{what} for the {backend} backend: expected a JSON object "
                         f"{_SCHEMAS[kind]}, got {type(value).__name__}")
    vllm_fields = [f for f in _VLLM_UPDATE_FIELDS if f in value] if kind in _UPDATE_KINDS else []
    if vllm_fields:
        raise ValueError(
            f"{what} for the {backend} backend: {', '.join(vllm_fields)} are vLLM's "
            f"per-tensor update_info, which describes another byte stream (one broadcast per "
            f"tensor, vLLM's own packing, or CUDA IPC handles); ringserve's {backend} "
            f"transport takes one bucket per call, {_SCHEMAS[kind]}, as "
            f"ringserve.weight_transfer.TrainerWeightTransferEngine sends it")
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{what} for the {backend} backend: {exc}; expected "
                         f"{_SCHEMAS[kind]}") from None


def encode(message: msgspec.Struct) -> dict[str, Any]:
    """`message` as a plain JSON object (lists, not tuples: what it is after a JSON trip)."""
    value: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(message))
    return value
