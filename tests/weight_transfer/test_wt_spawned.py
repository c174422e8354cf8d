"""Receivers in other processes (started with multiprocessing's "spawn", driven by JSON over
a pipe): shm and gloo rounds byte-exact across processes, and receivers that notice a killed
trainer within their timeout."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
from test_wt_shm import mixed_tensors
from wt_peer import PipeEngine, source_digests

from conftest import PeerPool
from ringserve.weight_transfer import (
    StateDictSource,
    TrainerWeightTransferEngine,
    WeightReceiver,
    WeightTransferConfig,
    WeightTransportError,
    make_receiver,
)

pytestmark = pytest.mark.slow  # each peer imports torch: seconds (once per session)


def _rounds(config: WeightTransferConfig, engine: PipeEngine, rounds: int) -> None:
    tensors = mixed_tensors()
    with TrainerWeightTransferEngine(config, engine, timeout_s=20) as trainer:
        trainer.trainer_init(StateDictSource(tensors))
        for round_ in range(rounds):
            trainer.send_weights()
            assert engine.received[round_] == source_digests(tensors), f"round {round_ + 1}"
            tensors["layers.1.q.weight"].add_(1)
            tensors["embed.weight"].mul_(0.5)
    assert engine.versions == [str(r + 1) for r in range(rounds)]


def test_shm_receiver_in_a_child_process(peer_pool: PeerPool) -> None:
    (peer,) = peer_pool.get(1)
    config = WeightTransferConfig("shm", bucket_bytes=1 << 20)
    engine = PipeEngine(config, [peer])
    try:
        _rounds(config, engine, rounds=2)
        # A bad bucket is refused in the child with the receiver's own message.
        with pytest.raises(RuntimeError, match="ValueError: update_info for the shm backend"):
            peer.call({"op": "receive", "update_info": {"segment": "x"}})
    finally:
        engine.close()


def test_gloo_two_receiver_processes(peer_pool: PeerPool) -> None:
    peers = peer_pool.get(2)
    config = WeightTransferConfig("gloo", bucket_bytes=1 << 20)
    engine = PipeEngine(config, peers)
    try:
        _rounds(config, engine, rounds=2)
    finally:
        engine.close()


def test_gloo_receivers_notice_a_killed_trainer(peer_pool: PeerPool) -> None:
    (peer,) = peer_pool.get(1)
    config = WeightTransferConfig("gloo")
    receivers: list[WeightReceiver] = []
    peer.send({"op": "trainer", "backend": "gloo", "world_size": 3, "timeout_s": 20})
    event = peer.recv()
    assert event["event"] == "init"
    errors: list[BaseException | None] = [None, None]
    made: list[Any] = [None, None]

    def join(index: int) -> None:
        made[index] = make_receiver(config, event["init_info"], worker_index=index,
                                    num_workers=2, timeout_s=3.0)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    receivers = [r for r in made if r is not None]
    try:
        assert len(receivers) == 2
        peer.send({"ok": True})
        assert peer.recv()["ok"]  # the trainer's trainer_init returned
        update_info = {"nbytes": 1 << 20, "tensors": [
            {"name": "w", "dtype": "uint8", "shape": [1 << 20], "offset": 0}]}
        raised_at: list[float] = [0.0, 0.0]

        def receive(index: int) -> None:
            try:
                list(receivers[index].receive(update_info))
            except BaseException as exc:
                errors[index] = exc
            raised_at[index] = time.monotonic()

        waiting = [threading.Thread(target=receive, args=(i,)) for i in range(2)]
        for thread in waiting:
            thread.start()
        time.sleep(0.3)  # both are inside the broadcast now
        killed_at = time.monotonic()
        os.kill(peer.process.pid, signal.SIGKILL)
        for thread in waiting:
            thread.join(10)
        assert not any(t.is_alive() for t in waiting), "a receiver hung"
        for error, at in zip(errors, raised_at, strict=True):
            assert isinstance(error, WeightTransportError), error
            assert "the trainer died" in str(error)
            assert at - killed_at < 3.0  # the timeout; a closed connection is seen at once
        with pytest.raises(WeightTransportError, match="closed"):
            receivers[0].receive(update_info)
    finally:
        for receiver in receivers:
            receiver.close()
        peer.process.join(5)

