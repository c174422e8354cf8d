"""Bucket layout: which tensors share a bucket, where each lies, packing on the trainer and
zero-copy views on the receiver.

Shared by both transports (``shm_transport``, ``collective``): a bucket is a byte buffer (a
shm segment, or the packed buffer of one broadcast) holding tensors in C order at offsets that
are multiples of :data:`ALIGN`. :func:`plan_buckets` fills buckets greedily in the source's
order; a tensor larger than a bucket travels alone in a bucket of its own size ("oversized").
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import torch

from ringserve.weight_transfer.messages import TensorSlot
from ringserve.weight_transfer.source import TensorMeta, dtype_from_name, dtype_name

ALIGN = 64  # a cache line, and a multiple of every element size


def align_up(offset: int) -> int:
    """`offset` rounded up to a multiple of :data:`ALIGN`."""
    return -(-offset // ALIGN) * ALIGN


class BucketPlan(msgspec.Struct, frozen=True):
    """One bucket: its tensors, their offsets, the bytes used, and whether it holds a single
    tensor larger than the bucket capacity."""

    slots: list[tuple[TensorMeta, int]]
    nbytes: int
    oversized: bool = False


def plan_buckets(metas: list[TensorMeta], capacity: int) -> list[BucketPlan]:
    """Group `metas` (in order) into buckets of at most `capacity` bytes.

    A tensor of more than `capacity` bytes gets a bucket of its own (``oversized``), so the
    plan covers any tensor; the buckets around it are unaffected.
    """
    buckets: list[BucketPlan] = []
    slots: list[tuple[TensorMeta, int]] = []
    end = 0
    for meta in metas:
        nbytes = meta.nbytes
        if nbytes > capacity:
            if slots:
                buckets.append(BucketPlan(slots, end))
                slots, end = [], 0
            buckets.append(BucketPlan([(meta, 0)], nbytes, oversized=True))
            continue
        offset = align_up(end)
        if slots and offset + nbytes > capacity:
            buckets.append(BucketPlan(slots, end))
            slots, offset = [], 0
        slots.append((meta, offset))
        end = offset + nbytes
    if slots:
        buckets.append(BucketPlan(slots, end))
    return buckets


def typed_view(buffer: torch.Tensor, offset: int, dtype: torch.dtype,
               shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of `dtype` and `shape` whose bytes start at `offset` of `buffer` (uint8)."""
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * dtype.itemsize
    return buffer[offset:offset + nbytes].view(dtype).view(shape)


def take(bucket: BucketPlan, tensors: Iterator[tuple[str, torch.Tensor]]
         ) -> list[tuple[TensorMeta, int, torch.Tensor]]:
    """The bucket's tensors, taken from `tensors` in order: (metadata, offset in the bucket,
    tensor) each.

    Raises:
        ValueError: the source ran out, or yielded a tensor whose name, dtype or shape is not
            the one its metadata announced (the engine checked the metadata, so a difference
            would load the wrong bytes).
    """
    items: list[tuple[TensorMeta, int, torch.Tensor]] = []
    for meta, offset in bucket.slots:
        item = next(tensors, None)
        if item is None:
            raise ValueError(f"the weight source stopped before {meta.name!r}, which its "
                             "metadata lists")
        name, tensor = item
        got = (name, dtype_name(tensor.dtype), tuple(int(d) for d in tensor.shape))
        if got != (meta.name, meta.dtype, meta.shape):
            raise ValueError(f"the weight source yielded {got[0]!r} ({got[1]}, shape "
                             f"{list(got[2])}) where its metadata announced {meta.name!r} "
                             f"({meta.dtype}, shape {list(meta.shape)})")
        # A trainer's own source may yield its live parameters: copying one that requires
        # grad would record the copy for autograd.
        items.append((meta, offset, tensor.detach()))
    return items


def copy_in(buffer: torch.Tensor, items: list[tuple[TensorMeta, int, torch.Tensor]]
            ) -> list[TensorSlot]:
    """Copy `take`'s tensors into `buffer` (uint8, long enough) at their offsets; their slots."""
    slots: list[TensorSlot] = []
    for meta, offset, tensor in items:
        typed_view(buffer, offset, tensor.dtype, meta.shape).copy_(tensor)
        slots.append(TensorSlot(meta.name, meta.dtype, meta.shape, offset))
    return slots


def pack(buffer: torch.Tensor, bucket: BucketPlan,
         tensors: Iterator[tuple[str, torch.Tensor]]) -> list[TensorSlot]:
    """Copy the bucket's tensors, taken from `tensors` in order, into `buffer` (uint8, at least
    ``bucket.nbytes`` long); returns their slots.

    Raises:
        ValueError: as `take`.
    """
    return copy_in(buffer, take(bucket, tensors))


class CheckedSlot(msgspec.Struct, frozen=True):
    """A slot whose dtype is known and whose bytes lie inside the bucket."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


def check_slots(slots: list[TensorSlot], size: int, where: str) -> list[CheckedSlot]:
    """Check every slot against a bucket of `size` bytes before any tensor is handed out.

    Raises:
        ValueError: an unknown dtype, an offset that is not a multiple of :data:`ALIGN`, or a
            tensor whose bytes run past the end of the bucket.
    """
    checked: list[CheckedSlot] = []
    for index, slot in enumerate(slots):
        label = f"tensors[{index}] ({slot.name!r})"
        try:
            dtype = dtype_from_name(slot.dtype)
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from None
        if slot.offset % ALIGN:
            raise ValueError(f"{label}: offset {slot.offset} is not a multiple of {ALIGN}")
        nbytes = TensorMeta(slot.name, slot.dtype, slot.shape).nbytes
        if slot.offset + nbytes > size:
            raise ValueError(f"{label}: bytes {slot.offset}..{slot.offset + nbytes} run past "
                             f"the end of {where} ({size} bytes)")
        checked.append(CheckedSlot(slot.name, dtype, slot.shape, slot.offset))
    return checked


def slot_views(buffer: torch.Tensor,
               slots: list[CheckedSlot]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each slot: views of `buffer` (uint8), nothing copied."""
    for slot in slots:
        yield slot.name, typed_view(buffer, slot.offset, slot.dtype, slot.shape)
