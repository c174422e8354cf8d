"""The worker side of a weight update: a receiver per engine worker, made at
``init_weight_transfer_engine`` and asked for one bucket's tensors per ``update_weights``.

The engine's worker (``ringserve.gpu.weights.update``) calls :func:`make_receiver` with the
trainer's ``init_info`` and then, per bucket, feeds :meth:`WeightReceiver.receive`'s
``(name, tensor)`` pairs to the model's loader, which copies each before the next is asked
for. Imports no engine code. Schemas: ``ringserve.weight_transfer.messages``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from ringserve.weight_transfer.config import WeightTransferConfig


class WeightReceiver(Protocol):
    """One worker's end of the channel from the trainer."""

    def receive(self, update_info: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """The bucket's ``(name, tensor)`` pairs, each valid until the iterator advances.

        Raises:
            ValueError: bad ``update_info`` (raised by the call, before any tensor).
            WeightTransportError: the transport failed or the trainer died (within the
                receiver's timeout).
        """
        ...

    def close(self) -> None:
        """Release the channel (idempotent)."""
        ...


def make_receiver(config: WeightTransferConfig, init_info: dict[str, Any], *, worker_index: int,
                  num_workers: int, timeout_s: float) -> WeightReceiver:
    """Open this worker's end of the channel the trainer described in `init_info`.

    Args:
        config: the engine's weight-transfer configuration (its backend must be the
            trainer's).
        init_info: what the trainer sent to ``init_weight_transfer_engine``.
        worker_index: this worker among every receiving worker of every engine
            (``engine_index * tp_size + tp_rank``).
        num_workers: how many workers receive.
        timeout_s: the longest any wait for the trainer may last.

    Raises:
        ValueError: bad `init_info` or arguments, or nccl without CUDA.
        WeightTransportError: the trainer's group could not be joined within `timeout_s`.
    """
    if not isinstance(init_info, dict):
        raise ValueError(f"init_info: expected a JSON object, got {type(init_info).__name__}")
    if not isinstance(timeout_s, int | float) or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if config.backend == "shm":
        from ringserve.weight_transfer.shm_transport import ShmReceiver

        return ShmReceiver(init_info)
    from ringserve.weight_transfer.collective import CollectiveReceiver

    return CollectiveReceiver(config.backend, init_info, worker_index=worker_index,
                              num_workers=num_workers, timeout_s=float(timeout_s))
