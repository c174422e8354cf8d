"""The gloo transport with the engine's workers as threads of this process: rounds, the
group's schema and size checks, timeouts, and a group rebuilt after a refused bucket."""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import pytest
import torch
from test_wt_shm import mixed_tensors
from wt_peer import FakeEngine, run_all, source_digests

from ringserve.weight_transfer import (
    StateDictSource,
    TrainerWeightTransferEngine,
    WeightTransferConfig,
    WeightTransportError,
    collective,
    make_receiver,
)

CONFIG = WeightTransferConfig("gloo", bucket_bytes=1 << 20)


def test_rounds_over_two_workers() -> None:
    tensors = mixed_tensors()
    engine = FakeEngine(CONFIG, num_workers=2)
    with TrainerWeightTransferEngine(CONFIG, engine, timeout_s=10) as trainer:
        trainer.trainer_init(StateDictSource(tensors))
        (init_info,) = engine.init_infos
        # vLLM's NCCLWeightTransferInitInfo fields, so a vLLM-shaped receiver reads it too.
        assert set(init_info) == {"master_address", "master_port", "rank_offset", "world_size"}
        assert init_info["world_size"] == 3 and init_info["master_port"] > 0
        assert init_info["rank_offset"] == 1
        for round_ in range(1, 3):
            assert trainer.send_weights() == str(round_)
            assert engine.received[-1] == source_digests(tensors)
            tensors["layers.0.q.weight"].mul_(-2)
        infos = engine.update_infos
        assert len(infos) >= 4 and all(set(i) == {"nbytes", "tensors"} for i in infos)
        assert max(i["nbytes"] for i in infos) == 700 * 1000 * 2  # the oversized one, alone
    engine.close()


def test_explicit_world_size_and_port_in_use() -> None:
    engine = FakeEngine(CONFIG, num_workers=1)
    with TrainerWeightTransferEngine(CONFIG, engine, timeout_s=10) as trainer:
        trainer.trainer_init(StateDictSource({"w": torch.arange(10.0)}), {"world_size": 2})
        trainer.send_weights()
        assert engine.received[0] == source_digests({"w": torch.arange(10.0)})
        port = engine.init_infos[0]["master_port"]
        other = TrainerWeightTransferEngine(CONFIG, FakeEngine(CONFIG), timeout_s=2)
        with pytest.raises(WeightTransportError, match="cannot serve"):
            other.trainer_init(StateDictSource({}), {"master_port": port})
        other.close()
    engine.close()


def test_the_trainer_needs_the_group_size() -> None:
    class NoWorldSize:
        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...
        def start_weight_update(self, metadata: dict[str, Any] | None = None) -> None: ...
        def update_weights(self, update_info: dict[str, Any]) -> None: ...
        def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    trainer = TrainerWeightTransferEngine(CONFIG, NoWorldSize())
    with pytest.raises(ValueError, match="world_size"):
        trainer.trainer_init(StateDictSource({}))
    with pytest.raises(ValueError, match=r"at `\$.master_port`"):
        trainer.trainer_init(StateDictSource({}), {"master_port": "x", "world_size": 2})
    with pytest.raises(ValueError, match="unknown field `segments`"):
        trainer.trainer_init(StateDictSource({}), {"segments": []})
    trainer.close()


@pytest.mark.parametrize(("init_info", "needle"), [
    ({"master_address": "127.0.0.1", "master_port": 1}, "missing required field `world_size`"),
    ({"master_address": "127.0.0.1", "master_port": 0, "world_size": 2}, "`int` >= 1"),
    ({"master_address": "127.0.0.1", "master_port": 70000, "world_size": 2}, "<= 65535"),
    ({"master_address": "127.0.0.1", "master_port": 1, "world_size": 5},
     "world_size 5, but the trainer and this engine's 2 workers make 3"),
    ({"master_address": 1, "master_port": 1, "world_size": 3}, "at `$.master_address`"),
])
def test_bad_init_info(init_info: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as info:
        make_receiver(CONFIG, init_info, worker_index=0, num_workers=2, timeout_s=1.0)
    assert needle in str(info.value)


def test_bad_worker_index() -> None:
    info = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 3}
    with pytest.raises(ValueError, match="worker_index 2 is not in"):
        make_receiver(CONFIG, info, worker_index=2, num_workers=2, timeout_s=1.0)


def test_nccl_without_cuda_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    nccl = WeightTransferConfig("nccl")
    info = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}
    with pytest.raises(ValueError, match="'nccl' needs CUDA devices"):
        make_receiver(nccl, info, worker_index=0, num_workers=1, timeout_s=1.0)
    with pytest.raises(ValueError, match="'nccl' needs CUDA devices"):
        TrainerWeightTransferEngine(nccl, FakeEngine(nccl)).trainer_init(StateDictSource({}))


@pytest.fixture
def quick_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    # How long the trainer lets a broadcast settle after the engine refused its bucket.
    monkeypatch.setattr(collective, "_SETTLE_S", 0.2)


class _Group:
    """A trainer (in this test) and `n` receivers joined by hand, so a test can make one side
    misbehave."""

    def __init__(self, n: int, timeout_s: float) -> None:
        self.engine = FakeEngine(CONFIG, num_workers=n, timeout_s=timeout_s)
        self.trainer = TrainerWeightTransferEngine(CONFIG, self.engine, timeout_s=timeout_s)
        self.trainer.trainer_init(StateDictSource({"w": torch.ones(64)}))

    def close(self) -> None:
        self.engine.close()
        self.trainer.close()


def test_bad_update_info_is_refused_before_the_broadcast() -> None:
    group = _Group(1, timeout_s=5.0)
    try:
        receiver = group.engine.receivers[0]
        start = time.monotonic()
        cases: list[tuple[dict[str, Any], str]] = [({"nbytes": -1, "tensors": []}, "at `$.nbytes`"),
                            ({"tensors": []}, "missing required field `nbytes`"),
                            ({"nbytes": 8, "tensors": [{"name": "w", "dtype": "float32",
                                                        "shape": [4], "offset": 0}]},
                             "run past the end of the bucket")]
        for bad, needle in cases:
            with pytest.raises(ValueError) as info:
                receiver.receive(bad)
            assert needle in str(info.value)
        assert time.monotonic() - start < 1.0  # nothing waited for the trainer
        group.trainer.send_weights()  # the group is still in step
        assert group.engine.received == [source_digests({"w": torch.ones(64)})]
    finally:
        group.close()


@pytest.mark.slow
@pytest.mark.usefixtures("quick_settle")
def test_a_silent_trainer_times_out_and_the_next_round_rebuilds_the_group() -> None:
    group = _Group(2, timeout_s=0.5)
    try:
        update_info = {"nbytes": 256, "tensors": [{"name": "w", "dtype": "float32",
                                                   "shape": [64], "offset": 0}]}
        errors: list[BaseException] = []

        def receive(receiver: Any) -> None:
            try:
                list(receiver.receive(update_info))
            except BaseException as exc:
                errors.append(exc)

        start = time.monotonic()
        run_all([functools.partial(receive, r) for r in group.engine.receivers])
        assert time.monotonic() - start < 0.5 + 1.5
        assert len(errors) == 2
        assert all(isinstance(e, WeightTransportError) for e in errors)
        assert all("sent nothing within 0.5 s" in str(e) for e in errors)
        # The receivers are broken now: the engine refuses the trainer's next bucket, the
        # trainer drops its group, and the round after that starts with a fresh one.
        with pytest.raises(WeightTransportError, match="init_weight_transfer_engine again"):
            group.trainer.send_weights()
        assert group.engine.calls.count("init") == 1
        group.trainer.send_weights()
        assert group.engine.calls.count("init") == 2
        assert group.engine.received == [source_digests({"w": torch.ones(64)})]
    finally:
        group.close()


@pytest.mark.slow
@pytest.mark.usefixtures("quick_settle")
def test_a_refused_bucket_drops_the_group_without_waiting_for_its_timeout() -> None:
    tensors = mixed_tensors()
    engine = FakeEngine(CONFIG, num_workers=1, timeout_s=30.0)
    engine.fail_update = 2
    with TrainerWeightTransferEngine(CONFIG, engine, timeout_s=30.0) as trainer:
        trainer.trainer_init(StateDictSource(tensors))
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="refused this bucket"):
            trainer.send_weights()
        assert time.monotonic() - start < 5.0  # not the 30 s the pending broadcast could wait
        assert trainer.send_weights() == "1"
        assert engine.calls.count("init") == 2
        assert engine.received == [source_digests(tensors)]
    engine.close()
    # The dropped group is released off the trainer's thread once its broadcast fails.
    deadline = time.monotonic() + 10
    while any(t.name == "weight-transfer-release" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the dropped group was never released"
        time.sleep(0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="nccl needs two CUDA devices (one per member)")
def test_nccl_round_trip_on_two_devices() -> None:
    # The trainer on cuda:0, one receiver on cuda:1 (NCCL refuses two members on one device).
    nccl = WeightTransferConfig("nccl", bucket_bytes=1 << 20)
    tensors = mixed_tensors()

    class OnDevice1(FakeEngine):
        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            def make() -> Any:
                torch.cuda.set_device(1)
                return make_receiver(nccl, init_info, worker_index=0, num_workers=1,
                                     timeout_s=30.0)
            self.close()
            self.receivers = run_all([make])

        def _receive(self, receiver: Any, info: dict[str, Any]) -> Any:
            torch.cuda.set_device(1)
            return super()._receive(receiver, info)

    torch.cuda.set_device(0)
    engine = OnDevice1(nccl)
    with TrainerWeightTransferEngine(nccl, engine, timeout_s=30.0) as trainer:
        trainer.trainer_init(StateDictSource(tensors), {"world_size": 2})
        trainer.send_weights()
        assert engine.received == [source_digests(tensors)]
    engine.close()
