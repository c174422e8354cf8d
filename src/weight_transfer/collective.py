"""The ``gloo`` and ``nccl`` transports: each bucket packed into one flat buffer and broadcast
from the trainer to every engine worker over a process group of their own.

The group is standalone: the trainer (rank 0) and every receiving worker (ranks
``rank_offset`` .. ``rank_offset + N - 1``, rank ``rank_offset + worker_index``, as in vLLM's
NCCL backend; a `TrainerWeightTransferEngine` sends ``rank_offset`` 1) build it directly from
a ``torch.distributed.TCPStore`` the trainer serves (``ProcessGroupGloo`` /
``ProcessGroupNCCL``, never ``init_process_group``: the workers' default group is their
tensor-parallel one and stays untouched). ``init_info`` names
the store; ``update_info`` describes one packed bucket (schema: ``messages``).

Every member must take part in a collective at once, so the trainer overlaps its side with
the client's call: at ``trainer_init`` it builds its group on a helper thread while
``init_weight_transfer_engine`` (the workers joining, in ``make_receiver``) runs on the
caller's thread; per bucket it starts the broadcast (asynchronous) and then calls
``update_weights``, during which each worker's receiver joins the broadcast before it yields a
single tensor. The trainer's packed buffer and each worker's receive buffer are reused from
bucket to bucket: the trainer repacks only after ``update_weights`` returned (every worker has
copied the bucket), and a worker's views are only valid until its next ``receive``.

Across hosts: the trainer's ``master_address`` must be one the workers reach (the default is
loopback), and each member's gloo device is torch's default for its host name
(``GLOO_SOCKET_IFNAME`` picks an interface).

Failures: a dead peer or a silent one makes the waiting side raise `WeightTransportError` (a
closed connection at once, silence after ``timeout_s``). A bucket the engine refused before its
workers joined the broadcast leaves the trainer's broadcast pending: the trainer then drops the
group (off the caller's thread: its destructor waits for the pending operation to time out) and
the next round rebuilds it with a fresh ``init_weight_transfer_engine``.

nccl is the same code on CUDA devices (the current device of each process; one device per
member, as NCCL requires) and is untested here: it has no CPU fallback, its broadcast is
asynchronous to the host (``wait`` orders the current stream), and a peer that dies mid-bucket
is noticed by NCCL's watchdog after ``timeout_s`` (torch's default handling aborts the
communicator), not by a closed connection as with gloo.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo, Store, TCPStore

from ringserve.weight_transfer.background import BackgroundCall, release_in_background
from ringserve.weight_transfer.buckets import (
    BucketPlan,
    check_slots,
    pack,
    plan_buckets,
    slot_views,
)
from ringserve.weight_transfer.errors import WeightTransportError
from ringserve.weight_transfer.messages import (
    CollectiveInitInfo,
    CollectiveTrainerOptions,
    CollectiveUpdateInfo,
    decode,
    encode,
)
from ringserve.weight_transfer.source import TensorMeta

ClientCall = Callable[[dict[str, Any]], Any]

# How long the trainer's broadcast may still take to settle after the engine answered a bucket
# with an error: every worker that joined it has finished by then.
_SETTLE_S = 1.0


def collective_device(backend: str) -> torch.device:
    """The device a member's buffers live on: the CPU for gloo, the current CUDA device for
    nccl.

    Raises:
        ValueError: nccl on a machine without CUDA devices.
    """
    if backend == "gloo":
        return torch.device("cpu")
    if not torch.cuda.is_available() or getattr(dist, "ProcessGroupNCCL", None) is None:
        raise ValueError("weight transfer backend 'nccl' needs CUDA devices and a torch built "
                         "with NCCL; use 'gloo' (CPU) or 'shm' (one host) here")
    return torch.device("cuda", torch.cuda.current_device())


def _new_group(backend: str, store: Store, rank: int, size: int, timeout_s: float) -> Any:
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return ProcessGroupGloo(store, rank, size, timeout)
    nccl: Any = getattr(dist, "ProcessGroupNCCL")  # noqa: B009 -- absent from CPU builds
    options = nccl.Options()
    options._timeout = timeout
    return nccl(store, rank, size, options)


class CollectiveSender:
    """The trainer's store, group and packed buffer (rank 0).

    Args:
        backend: "gloo" or "nccl".
        options: the trainer's ``init_info`` (address, port; the world size resolved).
        world_size: trainer + receiving workers.
        bucket_bytes: the configured bucket size.
        timeout_s: how long a join or a broadcast may wait for the workers.
    """

    def __init__(self, backend: str, options: CollectiveTrainerOptions, world_size: int,
                 bucket_bytes: int, timeout_s: float) -> None:
        self.backend = backend
        self.device = collective_device(backend)
        self.options = options
        self.world_size = world_size
        self.capacity = bucket_bytes
        self.timeout_s = timeout_s
        self._store: TCPStore | None = None
        self._group: Any = None
        self._buffer: torch.Tensor | None = None

    @property
    def broken(self) -> bool:
        """No usable group (never built, or dropped after a failed bucket)."""
        return self._group is None

    def connect(self, init: ClientCall) -> None:
        """Serve a fresh store, have the workers join (``init``) while rank 0 joins.

        Raises:
            Exception: what ``init`` raised (the engine refused, or its workers could not
                join), or `WeightTransportError` when rank 0 could not.
        """
        self.drop()
        timeout = timedelta(seconds=self.timeout_s)
        try:
            store = TCPStore(self.options.master_address, self.options.master_port,
                             self.world_size, is_master=True, wait_for_workers=False,
                             timeout=timeout)
        except Exception as exc:
            raise WeightTransportError(
                f"cannot serve the {self.backend} group's TCPStore at "
                f"{self.options.master_address}:{self.options.master_port}: {exc}") from exc
        info = CollectiveInitInfo(self.options.master_address, store.port, self.world_size,
                                  rank_offset=1)
        joining = BackgroundCall(
            lambda: _new_group(self.backend, store, 0, self.world_size, self.timeout_s),
            "weight-transfer-join")
        init(encode(info))  # on failure rank 0's join times out on its own thread
        error = joining.join()
        if error is not None:
            raise WeightTransportError(f"the trainer could not join the {self.backend} group "
                                       f"at {info.master_address}:{info.master_port}: "
                                       f"{error}") from error
        self._store, self._group = store, joining.value

    def plan(self, metas: list[TensorMeta]) -> list[BucketPlan]:
        """This round's buckets (any tensor fits: an oversized one travels alone)."""
        return plan_buckets(metas, self.capacity)

    def _buffer_for(self, bucket: BucketPlan) -> torch.Tensor:
        if bucket.oversized:  # not kept: one model's largest tensor may be very large
            return torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
        if self._buffer is None or self._buffer.numel() < bucket.nbytes:
            self._buffer = torch.empty(max(bucket.nbytes, 1), dtype=torch.uint8,
                                       device=self.device)
        return self._buffer[: bucket.nbytes]

    def send_round(self, plan: list[BucketPlan], tensors: Iterator[tuple[str, torch.Tensor]],
                   update: ClientCall) -> None:
        """Pack and broadcast every bucket, each during its ``update_weights`` call.

        Raises:
            Exception: what packing or ``update`` raised; `WeightTransportError` when the
                broadcast failed (the group is dropped; the next round rebuilds it).
        """
        for bucket in plan:
            if self._group is None:
                raise WeightTransportError(f"the {self.backend} weight-transfer group is closed")
            buffer = self._buffer_for(bucket)
            slots = pack(buffer, bucket, tensors)
            info = encode(CollectiveUpdateInfo(bucket.nbytes, slots))
            work = self._group.broadcast(buffer, 0) if bucket.nbytes else None
            try:
                update(info)
            except BaseException:
                if work is not None and not self._settles(work, _SETTLE_S):
                    self.drop([work])
                raise
            if work is not None and not self._settles(work, self.timeout_s):
                self.drop([work])
                raise WeightTransportError(
                    f"the {self.backend} broadcast of a {bucket.nbytes}-byte bucket did not "
                    f"complete within {self.timeout_s:g} s although the engine received it")

    @staticmethod
    def _settles(work: Any, timeout_s: float) -> bool:
        try:
            work.wait(timedelta(seconds=timeout_s))
        except Exception:
            return False
        return True

    def drop(self, pending: list[Any] | None = None) -> None:
        """Forget the group (and the store); `pending` operations keep it alive until they
        time out, off this thread."""
        if self._group is None:
            return
        # No local may hold the group: whichever reference goes last runs its destructor.
        doomed = [self._group, self._store, *(pending or [])]
        self._group = self._store = None
        release_in_background(doomed)

    def close(self) -> None:
        """Destroy the group and stop serving the store (idempotent)."""
        self.drop()
        self._buffer = None


class CollectiveReceiver:
    """A worker's membership of the trainer's group and its receive buffer.

    Its rank is ``rank_offset + worker_index``: the trainer's ranks come first (rank 0
    broadcasts), then the engine's workers, as vLLM's trainer scripts lay the group out.

    Raises:
        ValueError: bad ``init_info``, a world size that is not the trainer's ranks
            (``rank_offset``) plus the engine's workers, or nccl without CUDA.
        WeightTransportError: the store or the group could not be joined within `timeout_s`.
    """

    def __init__(self, backend: str, init_info: dict[str, Any], *, worker_index: int,
                 num_workers: int, timeout_s: float) -> None:
        info = decode(CollectiveInitInfo, init_info, "init_info", backend)
        if not 0 <= worker_index < num_workers:
            raise ValueError(f"worker_index {worker_index} is not in [0, {num_workers})")
        # Exact, not at least: a rank nobody takes would make every member's join wait out
        # its timeout, where a miscount is cheap to name now.
        expected = info.rank_offset + num_workers
        if info.world_size != expected:
            trainer = ("the trainer" if info.rank_offset == 1 else
                       f"the trainer's {info.rank_offset} ranks (rank_offset)")
            raise ValueError(f"init_info for the {backend} backend: world_size "
                             f"{info.world_size}, but {trainer} and this engine's "
                             f"{num_workers} workers make {expected}")
        self.backend = backend
        self.device = collective_device(backend)
        self.timeout_s = timeout_s
        self._buffer: torch.Tensor | None = None
        address = f"{info.master_address}:{info.master_port}"
        try:
            self._store: TCPStore | None = TCPStore(
                info.master_address, info.master_port, info.world_size, is_master=False,
                timeout=timedelta(seconds=timeout_s))
            self._group: Any = _new_group(backend, self._store,
                                          info.rank_offset + worker_index, info.world_size,
                                          timeout_s)
        except Exception as exc:
            raise WeightTransportError(f"could not join the trainer's {backend} group at "
                                       f"{address} within {timeout_s:g} s: {exc}") from exc

    def receive(self, update_info: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """Join the bucket's broadcast, then yield views of the receive buffer (valid until
        the next ``receive``).

        Raises:
            ValueError: bad ``update_info`` (before the broadcast and any tensor).
            WeightTransportError: the broadcast failed (the trainer died, or sent nothing
                within ``timeout_s``), or the receiver is closed or broken.
        """
        if self._group is None:
            raise WeightTransportError(f"the {self.backend} weight receiver is closed (or broke "
                                       "on an earlier bucket); init_weight_transfer_engine again")
        info = decode(CollectiveUpdateInfo, update_info, "update_info", self.backend)
        checked = check_slots(info.tensors, info.nbytes, "the bucket (nbytes)")
        if self._buffer is None or self._buffer.numel() < info.nbytes:
            self._buffer = None  # the old one is freed before the new one is taken
            self._buffer = torch.empty(max(info.nbytes, 1), dtype=torch.uint8,
                                       device=self.device)
        buffer = self._buffer[: info.nbytes]
        if info.nbytes:
            try:
                self._group.broadcast(buffer, 0).wait()
            except Exception as exc:
                self._drop()
                raise WeightTransportError(
                    f"receiving a {info.nbytes}-byte bucket over {self.backend} failed (the "
                    f"trainer died, or sent nothing within {self.timeout_s:g} s): {exc}"
                ) from exc
        return slot_views(buffer, checked)

    def _drop(self) -> None:
        if self._group is not None:
            doomed = [self._group, self._store]
            self._group = self._store = None
            release_in_background(doomed)

    def close(self) -> None:
        """Leave the group (idempotent)."""
        self._drop()
        self._buffer = None
