"""The shm transport in one process: byte-exact rounds, zero-copy views, safe bucket reuse,
clear errors for bad input, and no segment left behind."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from wt_peer import FakeEngine, source_digests

from ringserve.shm.segment import SHM_DIR, Segment
from ringserve.weight_transfer import (
    StateDictSource,
    TensorMeta,
    TrainerWeightTransferEngine,
    WeightTransferConfig,
    WeightTransportError,
    make_receiver,
)

CONFIG = WeightTransferConfig("shm", bucket_bytes=1 << 20)


def mixed_tensors() -> dict[str, torch.Tensor]:
    """bf16 and float32 (and a few more dtypes) over several 1 MiB buckets, one tensor bigger
    than a bucket, an empty one and a scalar."""
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(700, 1000, generator=gen).bfloat16(),  # 1.4 MB: oversized
        "layers.0.q.weight": torch.randn(300, 300, generator=gen),
        "layers.0.k.weight": torch.randn(200, 300, generator=gen).bfloat16(),
        "layers.0.norm.weight": torch.randn(300, generator=gen),
        "layers.0.mlp.weight": torch.randn(500, 300, generator=gen).half(),
        "layers.1.q.weight": torch.randn(300, 300, generator=gen),
        "layers.1.empty": torch.empty(0, 8, dtype=torch.bfloat16),
        "layers.1.scale": torch.tensor(0.5),
        "layers.1.mask": torch.rand(100, generator=gen) > 0.5,
        "layers.1.codes": torch.randint(-100, 100, (300, 300), generator=gen, dtype=torch.int8),
        "lm_head.weight": torch.randn(400, 400, generator=gen).bfloat16(),
    }


def _mutate(tensors: dict[str, torch.Tensor]) -> None:
    for tensor in tensors.values():
        if tensor.dtype == torch.bool:
            tensor.logical_not_()
        elif tensor.numel():
            tensor.add_(1)


def _segment_names(engine: FakeEngine) -> list[str]:
    names: list[str] = engine.init_infos[-1]["segments"]
    return names


def test_rounds_are_byte_exact_and_segments_go_at_close() -> None:
    tensors = mixed_tensors()
    engine = FakeEngine(CONFIG, num_workers=2, hold_s=0.005)
    with TrainerWeightTransferEngine(CONFIG, engine, timeout_s=5) as trainer:
        trainer.trainer_init(StateDictSource(tensors))
        names = _segment_names(engine)
        assert [n.rsplit("-", 1)[1] for n in names] == ["wt_a", "wt_b", "wt_big"]
        for name in names:
            assert oct(os.stat(os.path.join(SHM_DIR, name)).st_mode & 0o777) == "0o600"
        for round_ in range(1, 4):
            assert trainer.send_weights() == str(round_)
            assert engine.received[-1] == source_digests(tensors)
            _mutate(tensors)
        assert trainer.send_weights("step-40") == "step-40"
        assert engine.versions == ["1", "2", "3", "step-40"]
        metadata = engine.metadata[-1]
        assert metadata is not None and metadata["names"] == list(tensors)
        assert metadata["dtype_names"][:2] == ["bfloat16", "float32"]
        # The bucket reads overlapped filling, but never two update_weights at once.
        assert engine.max_in_flight == 1
        assert engine.calls[:2] == ["init", "start"] and engine.calls[-1] == "finish"
    engine.close()
    assert not [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]
    trainer.close()  # idempotent


def test_update_info_schema_and_zero_copy() -> None:
    tensors = {"a": torch.ones(4, 4), "b": torch.zeros(3, dtype=torch.bfloat16)}
    engine = FakeEngine(CONFIG)
    with TrainerWeightTransferEngine(CONFIG, engine) as trainer:
        trainer.trainer_init(StateDictSource(tensors))
        assert len(_segment_names(engine)) == 1  # one bucket: no second segment
        trainer.send_weights()
        (info,) = engine.update_infos
        assert info == {"segment": _segment_names(engine)[0], "tensors": [
            {"name": "a", "dtype": "float32", "shape": [4, 4], "offset": 0},
            {"name": "b", "dtype": "bfloat16", "shape": [3], "offset": 64}]}
        receiver = engine.receivers[0]
        base: torch.Tensor = receiver._bytes[info["segment"]]  # type: ignore[attr-defined]
        for _, view in receiver.receive(info):
            assert view.untyped_storage().data_ptr() == base.data_ptr()  # a view, no copy
    engine.close()


def test_single_worker_in_process_default_bucket() -> None:
    tensors = mixed_tensors()
    engine = FakeEngine(WeightTransferConfig())
    with TrainerWeightTransferEngine(None, engine) as trainer:  # shm, 256 MiB buckets
        trainer.trainer_init(StateDictSource(tensors))
        trainer.send_weights()
        assert len(engine.update_infos) == 1
        assert engine.received == [source_digests(tensors)]
        # Sized to the round, not to bucket_bytes.
        size = os.stat(os.path.join(SHM_DIR, _segment_names(engine)[0])).st_size
        assert size < 4 << 20
    engine.close()


@pytest.fixture
def receiver_and_info() -> Iterator[tuple[Any, dict[str, Any], str]]:
    engine = FakeEngine(CONFIG)
    trainer = TrainerWeightTransferEngine(CONFIG, engine)
    try:
        trainer.trainer_init(StateDictSource({"w": torch.ones(8)}))
        trainer.send_weights()
        yield engine.receivers[0], engine.update_infos[0], _segment_names(engine)[0]
    finally:
        engine.close()
        trainer.close()


def _slot(**change: Any) -> dict[str, Any]:
    return {"name": "w", "dtype": "float32", "shape": [8], "offset": 0, **change}


@pytest.mark.parametrize(("update_info", "needle"), [
    ({"tensors": []}, "missing required field `segment`"),
    ({"segment": 3, "tensors": []}, "Expected `str`, got `int` - at `$.segment`"),
    ({"segment": "S", "tensors": [_slot(offset=-64)]}, "at `$.tensors[0].offset`"),
    ({"segment": "S", "tensors": [_slot(shape=[8.0])]}, "at `$.tensors[0].shape[0]`"),
    ({"segment": "S", "tensors": [_slot(name=None)]}, "at `$.tensors[0].name`"),
    ({"segment": "S", "tensors": [_slot(extra=1)]}, "unknown field `extra`"),
    ({"segment": "S", "tensors": [_slot(dtype="float128")]}, "unknown dtype 'float128'"),
    ({"segment": "S", "tensors": [_slot(offset=32)]}, "not a multiple of 64"),
    ({"segment": "S", "tensors": [_slot(shape=[1 << 30])]}, "run past the end of segment"),
    ({"segment": "ringserve-1-ab-wt_a", "tensors": []}, "is not one of init_info's segments"),
    ({"segment": "S", "tensors": "w"}, "Expected `array`, got `str` - at `$.tensors`"),
    ([], "expected a JSON object"),
])
def test_bad_update_info_is_refused_before_any_tensor(
        receiver_and_info: tuple[Any, dict[str, Any], str], update_info: Any,
        needle: str) -> None:
    receiver, _, segment = receiver_and_info
    if isinstance(update_info, dict) and update_info.get("segment") == "S":
        update_info = {**update_info, "segment": segment}
    with pytest.raises(ValueError) as info:
        receiver.receive(update_info)  # raises at the call, not at the first next()
    assert needle in str(info.value)


def test_closed_receiver(receiver_and_info: tuple[Any, dict[str, Any], str]) -> None:
    receiver, update_info, _ = receiver_and_info
    receiver.close()
    receiver.close()
    with pytest.raises(WeightTransportError, match="closed"):
        receiver.receive(update_info)


@pytest.mark.parametrize(("init_info", "needle"), [
    ({}, "missing required field `segments`"),
    ({"segments": "x"}, "Expected `array`, got `str` - at `$.segments`"),
    ({"segments": ["/etc/passwd"]}, "not a ringserve segment name: '/etc/passwd'"),
    ({"segments": ["../ringserve-1-ab-x"]}, "not a ringserve segment name"),
    ({"segments": ["ringserve-1-abcdef-wt_a"]}, "does not exist"),
    ({"segments": [], "host": "x"}, "unknown field `host`"),
    ("segments", "expected a JSON object"),
])
def test_bad_init_info(init_info: Any, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        make_receiver(CONFIG, init_info, worker_index=0, num_workers=1, timeout_s=1.0)
    assert needle in str(info.value)


def test_a_segment_too_small_to_be_a_bucket() -> None:
    segment = Segment.create("wt_tiny", 8)
    try:
        with pytest.raises(ValueError, match="is 8 bytes, not a weight bucket"):
            make_receiver(CONFIG, {"segments": [segment.name]}, worker_index=0, num_workers=1,
                          timeout_s=1.0)
    finally:
        segment.close()


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan")])
def test_bad_timeout(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        make_receiver(CONFIG, {"segments": []}, worker_index=0, num_workers=1,
                      timeout_s=timeout_s)


def test_a_failed_round_is_abandoned_and_the_next_works() -> None:
    tensors = mixed_tensors()
    engine = FakeEngine(CONFIG)
    engine.fail_update = 2  # the second bucket of the first round
    with TrainerWeightTransferEngine(CONFIG, engine) as trainer:
        trainer.trainer_init(StateDictSource(tensors))
        with pytest.raises(RuntimeError, match="refused this bucket"):
            trainer.send_weights()
        assert engine.calls.count("finish") == 0 and trainer.rounds == 0
        calls = len(engine.calls)
        assert trainer.send_weights() == "1"
        assert engine.calls[calls:][0] == "start" and engine.received == [source_digests(tensors)]
    engine.close()


class _LyingSource:
    """Announces one tensor list, yields another on request."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.lie: str | None = None

    def metadata(self) -> list[TensorMeta]:
        return StateDictSource(self.tensors).metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.tensors.items():
            yield name, tensor.double() if name == self.lie else tensor
        if self.lie == "extra":
            yield "extra", torch.zeros(1)


@pytest.mark.parametrize("lie", ["layers.1.q.weight", "extra"])
def test_a_source_that_breaks_its_metadata(lie: str) -> None:
    source = _LyingSource(mixed_tensors())
    engine = FakeEngine(CONFIG)
    with TrainerWeightTransferEngine(CONFIG, engine) as trainer:
        trainer.trainer_init(source)
        source.lie = lie
        with pytest.raises(ValueError, match=f"yielded '{lie}'"):
            trainer.send_weights()
        assert "finish" not in engine.calls
        source.lie = None
        trainer.send_weights()
        assert engine.received == [source_digests(source.tensors)]
    engine.close()


def test_a_tensor_larger_than_the_init_segments() -> None:
    tensors = {"a": torch.zeros(10)}
    engine = FakeEngine(CONFIG)
    with TrainerWeightTransferEngine(CONFIG, engine) as trainer:
        trainer.trainer_init(StateDictSource(tensors))
        tensors["b"] = torch.zeros(1 << 19)  # 2 MiB: no segment for it
        with pytest.raises(ValueError, match="larger than the shm segments made at trainer_init"):
            trainer.send_weights()
        assert engine.calls == ["init"]  # refused before start_weight_update
    engine.close()


def test_trainer_misuse() -> None:
    engine = FakeEngine(CONFIG)
    trainer = TrainerWeightTransferEngine('{"backend": "shm"}', engine)
    with pytest.raises(RuntimeError, match="trainer_init"):
        trainer.send_weights()
    with pytest.raises(TypeError, match="WeightSource"):
        trainer.trainer_init({"a": torch.zeros(1)})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the trainer takes none"):
        trainer.trainer_init(StateDictSource({}), {"master_port": 1})
    with pytest.raises(ValueError, match=r"at `\$.backend`"):
        TrainerWeightTransferEngine({"backend": "tcp"}, engine)
    with pytest.raises(ValueError, match="timeout_s"):
        TrainerWeightTransferEngine(None, engine, timeout_s=0)
    trainer.close()
    with pytest.raises(RuntimeError, match="closed"):
        trainer.send_weights()


def test_engine_refusing_init_leaves_no_segment() -> None:
    class Refusing(FakeEngine):
        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            raise RuntimeError("weight transfer is off")

    trainer = TrainerWeightTransferEngine(CONFIG, Refusing(CONFIG))
    with pytest.raises(RuntimeError, match="weight transfer is off"):
        trainer.trainer_init(StateDictSource({"a": torch.zeros(4)}))
    trainer.close()  # the autouse fixture checks /dev/shm
