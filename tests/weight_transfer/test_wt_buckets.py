"""Bucket layout: greedy, aligned, order-preserving; oversized tensors alone; packing checks
what the source yields against its metadata."""

from __future__ import annotations

import pytest
import torch

from ringserve.weight_transfer.buckets import (
    ALIGN,
    check_slots,
    pack,
    plan_buckets,
    slot_views,
)
from ringserve.weight_transfer.messages import TensorSlot
from ringserve.weight_transfer.source import TensorMeta


def _meta(name: str, nbytes: int) -> TensorMeta:
    return TensorMeta(name, "uint8", (nbytes,))


def test_plan_is_greedy_aligned_and_ordered() -> None:
    metas = [_meta("a", 100), _meta("b", 30), _meta("c", 60), _meta("big", 300),
             _meta("d", 0), _meta("e", 1)]
    plan = plan_buckets(metas, 200)
    assert [[(m.name, off) for m, off in b.slots] for b in plan] == [
        [("a", 0), ("b", 128)],  # c would end at 252 > 200
        [("c", 0)],
        [("big", 0)],
        [("d", 0), ("e", 0)],
    ]
    assert [b.nbytes for b in plan] == [158, 60, 300, 1]
    assert [b.oversized for b in plan] == [False, False, True, False]
    assert all(off % ALIGN == 0 for b in plan for _, off in b.slots)
    assert [m for b in plan for m, _ in b.slots] == metas


def test_plan_edge_cases() -> None:
    assert plan_buckets([], 1 << 20) == []
    exact = plan_buckets([_meta("a", 64), _meta("b", 64)], 128)
    assert len(exact) == 1 and exact[0].nbytes == 128


def test_pack_and_views_round_trip() -> None:
    tensors = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "y": torch.tensor([1.5, -2.0], dtype=torch.bfloat16), "z": torch.tensor(True)}
    metas = [TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
             for n, t in tensors.items()]
    (bucket,) = plan_buckets(metas, 1 << 10)
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    slots = pack(buffer, bucket, iter(tensors.items()))
    assert [s.offset for s in slots] == [0, 64, 128]
    views = list(slot_views(buffer, check_slots(slots, buffer.numel(), "b")))
    for (name, view), (want_name, want) in zip(views, tensors.items(), strict=True):
        assert name == want_name and view.dtype == want.dtype and torch.equal(view, want)
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


@pytest.mark.parametrize(("yielded", "needle"), [
    ([], "stopped before 'x'"),
    ([("w", torch.zeros(2))], "yielded 'w'"),
    ([("x", torch.zeros(3))], "shape [3]"),
    ([("x", torch.zeros(2, dtype=torch.float16))], "(float16"),
])
def test_pack_refuses_what_the_metadata_did_not_announce(
        yielded: list[tuple[str, torch.Tensor]], needle: str) -> None:
    (bucket,) = plan_buckets([TensorMeta("x", "float32", (2,))], 1 << 10)
    with pytest.raises(ValueError) as info:
        pack(torch.zeros(64, dtype=torch.uint8), bucket, iter(yielded))
    assert needle in str(info.value)


@pytest.mark.parametrize(("slot", "needle"), [
    (TensorSlot("t", "float33", (1,), 0), "unknown dtype 'float33'"),
    (TensorSlot("t", "float32", (1,), 4), "not a multiple of 64"),
    (TensorSlot("t", "float32", (17,), 64), "run past the end"),
    (TensorSlot("t", "uint8", (1,), 128), "run past the end"),
])
def test_check_slots(slot: TensorSlot, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        check_slots([TensorSlot("ok", "uint8", (8,), 0), slot], 128, "the bucket")
    assert needle in str(info.value) and "tensors[1] ('t')" in str(info.value)
    assert check_slots([TensorSlot("t", "float32", (16,), 64)], 128, "b")[0].offset == 64
