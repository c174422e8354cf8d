"""Tensor-parallel process group: the rank, the world size and the two collectives TP needs.

Owned by the worker (it creates the group in `init_device`) and handed to every parallel layer
at construction (`ringserve.gpu.layers.linear`, `ringserve.gpu.layers.vocab_embedding`). With a world size of
1 the collectives return their input untouched and torch.distributed is never initialised, so
a single-device run pays nothing for tensor parallelism.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of its tensor-parallel group.

    Attributes:
        rank: this rank (0-based).
        world_size: ranks in the group; 1 means no distributed work at all.
        group: the torch.distributed process group (None when world_size is 1: the default
            group is used).
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group in place (a no-op at world size 1)."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard_size(self, total: int, what: str) -> int:
        """`total / world_size`, or a clear error when `total` does not divide evenly.

        Raises:
            ValueError: `total` is not a multiple of the world size.
        """
        if total % self.world_size:
            raise ValueError(
                f"tensor_parallel_size {self.world_size} must divide {what} ({total})"
            )
        return total // self.world_size


def init_tp_group(rank: int, world_size: int, *, backend: str, init_method: str) -> TPGroup:
    """Join (or, at world size 1, skip) the torch.distributed group for tensor parallelism.

    Args:
        rank: this worker's rank.
        world_size: number of TP ranks.
        backend: "gloo" (CPU) or "nccl" (CUDA).
        init_method: a torch.distributed init URL (e.g. "tcp://127.0.0.1:29500").
    """
    if world_size == 1:
        return TPGroup()
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return TPGroup(rank=rank, world_size=world_size, group=dist.group.WORLD)


# The frontend's store for groups that span engine cores (expert parallelism across
# data-parallel ranks: `ringserve.engine.core.dp_wave`, `ringserve.gpu.moe.dispatch`).
STORE_HOST = "127.0.0.1"


def serve_store() -> Any:
    """A TCPStore served on a free loopback port (its `.port` goes to the engine cores)."""
    from torch._C._distributed_c10d import TCPStore

    return TCPStore(STORE_HOST, 0, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=300))


# How long joining a group may wait for its other ranks (a peer may be a core process being
# restarted after a fault, or one whose operator has not sent `retry` yet).
RENDEZVOUS_TIMEOUT_S = 300.0


def connect_store(port: int) -> Any:
    """A client of the store served by `serve_store` on `port` (its waits, a group's
    rendezvous among them, last up to `RENDEZVOUS_TIMEOUT_S`)."""
    from torch._C._distributed_c10d import TCPStore

    return TCPStore(STORE_HOST, port, is_master=False,
                    timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S))


def gloo_group(store: Any, prefix: str, rank: int, size: int, timeout_s: float) -> Any:
    """A standalone gloo process group of `size` ranks meeting under `prefix` in `store`
    (raw `ProcessGroup` API: `allreduce`, `alltoall_base`); a collective gives up on a
    silent peer after `timeout_s` (a closed connection fails it at once)."""
    from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

    # Gloo's own rendezvous waits only `timeout_s` for the other ranks: first wait here, up
    # to the rendezvous timeout, until every rank has arrived.
    key = f"{prefix}/arrived"
    store.add(key, 1)
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    while store.add(key, 0) < size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{prefix}: not every one of {size} ranks arrived within "
                               f"{RENDEZVOUS_TIMEOUT_S:g} s")
        time.sleep(0.02)
    return ProcessGroupGloo(PrefixStore(prefix, store), rank, size, timedelta(seconds=timeout_s))
