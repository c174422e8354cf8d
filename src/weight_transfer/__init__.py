"""Weights from an RL trainer into a running engine: the trainer side and the transports.

Owns the four-phase protocol's moving parts (vLLM's weight-transfer API):
``init_weight_transfer_engine`` once, then per round ``start_weight_update`` (metadata),
``update_weights`` per bucket and ``finish_weight_update`` (version). The trainer's
`TrainerWeightTransferEngine` drives them through a sync client (`WeightSyncClient` over
HTTP, or an in-process `LLM`) from a `WeightSource`; each engine worker opens a receiver with
`make_receiver` and feeds what `WeightReceiver.receive` yields to its model's loader (the
engine side lives in ``ringserve.engine.core.weight_sync`` and ``ringserve.gpu.weights.update``;
this package imports neither).

Transports (`WeightTransferConfig.backend`): ``shm`` (one host: shared-memory segments read in
place, ``shm_transport``; a trainer's parameters kept in shared memory, `SharedWeights`, are
sent without a copy), ``gloo`` (any hosts, CPU) and ``nccl`` (CUDA) (a standalone
process group, one broadcast per bucket, ``collective``). Wire schemas: ``messages``; bucket
layout: ``buckets``.

Importing the package imports only the configuration (no torch): the other names load on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ringserve.weight_transfer.config import WeightTransferConfig, parse_weight_transfer_config
from ringserve.weight_transfer.errors import WeightSyncError, WeightTransportError

if TYPE_CHECKING:
    from ringserve.weight_transfer.client import WeightSyncClient
    from ringserve.weight_transfer.receiver import WeightReceiver, make_receiver
    from ringserve.weight_transfer.shared_weights import SharedWeights
    from ringserve.weight_transfer.source import (
        ModuleWeightSource,
        StateDictSource,
        TensorMeta,
        TensorRecord,
        WeightSource,
        dtype_from_name,
        dtype_name,
        metadata_dict,
        tensor_metas,
    )
    from ringserve.weight_transfer.trainer import (
        TrainerWeightTransferEngine,
        VLLMWeightSyncClientProtocol,
        WeightSyncClientProtocol,
    )

_LAZY = {
    "WeightSyncClient": "client",
    "WeightReceiver": "receiver",
    "make_receiver": "receiver",
    "SharedWeights": "shared_weights",
    "ModuleWeightSource": "source",
    "StateDictSource": "source",
    "TensorMeta": "source",
    "TensorRecord": "source",
    "WeightSource": "source",
    "dtype_from_name": "source",
    "dtype_name": "source",
    "metadata_dict": "source",
    "tensor_metas": "source",
    "TrainerWeightTransferEngine": "trainer",
    "VLLMWeightSyncClientProtocol": "trainer",
    "WeightSyncClientProtocol": "trainer",
}

__all__ = [
    "ModuleWeightSource",
    "SharedWeights",
    "StateDictSource",
    "TensorMeta",
    "TensorRecord",
    "TrainerWeightTransferEngine",
    "VLLMWeightSyncClientProtocol",
    "WeightReceiver",
    "WeightSource",
    "WeightSyncClient",
    "WeightSyncClientProtocol",
    "WeightSyncError",
    "WeightTransferConfig",
    "WeightTransportError",
    "dtype_from_name",
    "dtype_name",
    "make_receiver",
    "metadata_dict",
    "parse_weight_transfer_config",
    "tensor_metas",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
