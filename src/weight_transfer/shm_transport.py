"""The ``shm`` transport: buckets in shared-memory segments, read in place by every worker.

For a trainer and an engine on one host. The trainer (:class:`ShmSender`) creates its bucket
segments once, at ``trainer_init`` (``ringserve.shm.segment.Segment``: mode 0600, a per-run
name, unlinked by the trainer at ``close`` or exit, or by the engine's stale cleanup if the
trainer was killed), and sends their names as ``init_info``; each worker's receiver
(:class:`ShmReceiver`) maps every segment once. Per bucket the trainer copies the tensors into
a segment and calls ``update_weights`` with their slots (schema: ``messages``); a worker yields
views of its mapping (no copy on the receiving side) which the model's loader copies from.

Segments: two of the largest bucket's size (at most ``bucket_bytes``), used alternately, so
the trainer fills the next bucket while the previous ``update_weights`` runs on a helper
thread; one when the whole round fits in a bucket; plus, when a tensor is larger than
``bucket_bytes``, one segment of the largest such tensor's size, in which each oversized
tensor travels alone. The segment pages are reserved up front (``posix_fallocate``), so a
``/dev/shm`` too small for them fails at ``trainer_init`` rather than with SIGBUS mid-copy, and
mapped up front on both sides (``MADV_POPULATE_*``), so the first round copies at the speed of
the later ones.

A `SharedWeights` source (``shared_weights``: the trainer's parameters moved into a segment of
their own) adds its segment to ``init_info``; a bucket whose tensors all lie in it is sent as
slots of that segment, with nothing copied on either side.

Reuse is safe because a segment is refilled only after the ``update_weights`` call that read
it has returned, and the engine returns only once every worker has loaded (copied) the bucket.
At most one ``update_weights`` call is in flight, and the segment being filled is never the
one it reads.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ringserve.shm.segment import SHM_DIR, Segment
from ringserve.weight_transfer.background import BackgroundCall
from ringserve.weight_transfer.buckets import (
    ALIGN,
    BucketPlan,
    check_slots,
    copy_in,
    plan_buckets,
    slot_views,
    take,
)
from ringserve.weight_transfer.errors import WeightTransportError
from ringserve.weight_transfer.messages import (
    ShmInitInfo,
    ShmUpdateInfo,
    TensorSlot,
    decode,
    encode,
)
from ringserve.weight_transfer.segments import create_segment, prefault
from ringserve.weight_transfer.source import TensorMeta

if TYPE_CHECKING:
    from ringserve.weight_transfer.shared_weights import SharedWeights

UpdateCall = Callable[[dict[str, Any]], Any]


class ShmSender:
    """The trainer's segments and its side of a round.

    Args:
        bucket_bytes: the configured bucket size.
        metas: the source's tensors at ``trainer_init`` (they size the segments).
        shared: the source when it is a `SharedWeights`: its segment is listed in
            ``init_info``, and buckets whose tensors all lie in it are sent in place.
    """

    broken = False  # a shm channel cannot break: nothing is in flight between rounds

    def __init__(self, bucket_bytes: int, metas: list[TensorMeta],
                 shared: SharedWeights | None = None) -> None:
        self._shared = shared
        self.sent_in_place = 0  # buckets of the last round sent without a copy
        plan = plan_buckets(metas, bucket_bytes)
        normal = [bucket.nbytes for bucket in plan if not bucket.oversized]
        oversized = [bucket.nbytes for bucket in plan if bucket.oversized]
        self.capacity = max([ALIGN, *normal])
        self._segments: list[Segment] = []
        try:
            for label in ("wt_a", "wt_b")[: 2 if len(normal) > 1 else 1]:
                self._segments.append(create_segment(label, self.capacity))
            self._big = create_segment("wt_big", max(oversized)) if oversized else None
        except BaseException:
            self.close()
            raise
        self._normal = list(self._segments)
        if self._big is not None:
            self._segments.append(self._big)
        self._bytes = {seg.name: torch.frombuffer(seg.mapping, dtype=torch.uint8)
                       for seg in self._segments}

    def init_info(self) -> dict[str, Any]:
        """``{"segments": [name, ...]}``: the bucket segments, then the shared one."""
        names = [seg.name for seg in self._segments]
        if self._shared is not None and self._shared.segment is not None:
            names.append(self._shared.segment.name)
        return encode(ShmInitInfo(names))

    def connect(self, init: UpdateCall) -> None:
        """Send the segment names (``init_weight_transfer_engine``)."""
        init(self.init_info())

    def plan(self, metas: list[TensorMeta]) -> list[BucketPlan]:
        """This round's buckets.

        Raises:
            ValueError: a tensor larger than every segment made at ``trainer_init``.
        """
        plan = plan_buckets(metas, self.capacity)
        big = 0 if self._big is None else self._big.size
        for bucket in plan:
            if bucket.oversized and bucket.nbytes > big:
                name = bucket.slots[0][0].name
                raise ValueError(f"tensor {name!r} ({bucket.nbytes} bytes) is larger than the "
                                 "shm segments made at trainer_init; call trainer_init again "
                                 "with a source that has it")
        return plan

    def send_round(self, plan: list[BucketPlan], tensors: Iterator[tuple[str, torch.Tensor]],
                   update: UpdateCall) -> None:
        """Fill and send every bucket, filling the next while the previous is received.

        Raises:
            Exception: whatever packing or ``update`` raised; no call is left in flight.
        """
        inflight: BackgroundCall | None = None
        normal = 0
        self.sent_in_place = 0
        try:
            for bucket in plan:
                items = take(bucket, tensors)
                in_place = self._in_place(items)
                if in_place is not None:  # the trainer's shared parameters, read where they lie
                    info = in_place
                    segment = None
                    self.sent_in_place += 1
                else:
                    if bucket.oversized and self._big is not None:
                        segment = self._big
                    else:  # plan() refused oversized buckets without a big segment
                        segment = self._normal[normal % len(self._normal)]
                        normal += 1
                    if inflight is not None and inflight.tag is segment:
                        inflight.result()
                        inflight = None
                    slots = copy_in(self._bytes[segment.name], items)
                    info = encode(ShmUpdateInfo(segment.name, slots))
                if inflight is not None:
                    inflight.result()
                    inflight = None
                inflight = BackgroundCall(functools.partial(update, info),
                                          "weight-transfer-update", tag=segment)
            if inflight is not None:
                inflight.result()
                inflight = None
        except BaseException as exc:
            if inflight is not None:  # never leave a call reading a segment we may refill
                error = inflight.join()
                if error is not None and error is not exc:
                    exc.add_note(f"the previous bucket's update_weights also failed: {error!r}")
            raise

    def _in_place(self, items: list[tuple[TensorMeta, int, torch.Tensor]]
                  ) -> dict[str, Any] | None:
        """The bucket's ``update_info`` as slots of the shared segment, when every tensor of
        it lies there; else None (the bucket is copied)."""
        shared = self._shared
        segment = None if shared is None else shared.segment
        if shared is None or segment is None or not items:
            return None
        slots: list[TensorSlot] = []
        for meta, _, tensor in items:
            offset = shared.offset_of(tensor)
            if offset is None:
                return None
            slots.append(TensorSlot(meta.name, meta.dtype, meta.shape, offset))
        return encode(ShmUpdateInfo(segment.name, slots))

    def close(self) -> None:
        """Unmap and unlink the segments (idempotent); a `SharedWeights` source is the
        trainer's to close."""
        self._bytes = {}
        for segment in self._segments:
            with contextlib.suppress(BufferError):  # a caller still holds a view
                segment.close()
        self._segments = []


class ShmReceiver:
    """A worker's mappings of the trainer's segments.

    Raises:
        ValueError: bad ``init_info``: not the schema, a name that is not a ringserve segment,
            or a segment that does not exist (the trainer is gone, or on another host).
    """

    def __init__(self, init_info: dict[str, Any]) -> None:
        info = decode(ShmInitInfo, init_info, "init_info", "shm")
        self._segments: dict[str, Segment] = {}
        try:
            for name in info.segments:
                if name not in self._segments:
                    self._segments[name] = self._attach(name)
        except BaseException:
            self.close()
            raise
        self._bytes = {name: torch.frombuffer(seg.mapping, dtype=torch.uint8)
                       for name, seg in self._segments.items()}

    @staticmethod
    def _attach(name: str) -> Segment:
        try:
            segment = Segment.attach(name)
        except ValueError as exc:
            raise ValueError(f"init_info for the shm backend: {exc}") from None
        except FileNotFoundError:
            raise ValueError(f"init_info for the shm backend: segment {name!r} does not exist "
                             f"in {SHM_DIR} (the trainer has exited, or runs on another host "
                             "or container: shm needs both on one host)") from None
        if segment.size < ALIGN:
            segment.close()
            raise ValueError(f"init_info for the shm backend: segment {name!r} is "
                             f"{segment.size} bytes, not a weight bucket")
        prefault(segment, write=False)
        return segment

    def receive(self, update_info: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """The bucket's tensors: views of the segment, valid until the trainer refills it
        (after this ``update_weights`` call returns).

        Raises:
            ValueError: bad ``update_info`` (raised here, before any tensor is yielded).
            WeightTransportError: the receiver is closed.
        """
        if not self._bytes:
            raise WeightTransportError("the shm weight receiver is closed")
        info = decode(ShmUpdateInfo, update_info, "update_info", "shm")
        buffer = self._bytes.get(info.segment)
        if buffer is None:
            raise ValueError(f"update_info for the shm backend: segment {info.segment!r} is not "
                             f"one of init_info's segments {sorted(self._bytes)}")
        checked = check_slots(info.tensors, buffer.numel(), f"segment {info.segment!r}")
        return slot_views(buffer, checked)

    def close(self) -> None:
        """Unmap the segments (idempotent); a mapping a caller still views stays mapped until
        the last view is gone."""
        self._bytes = {}
        for segment in self._segments.values():
            with contextlib.suppress(BufferError):
                segment.close()
        self._segments = {}
