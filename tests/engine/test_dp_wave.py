"""The lockstep waves' consensus interval (`--dp-sync-interval`, `ringserve.engine.core.dp_wave`):
two cores' `WaveSync` over a real store and gloo group (threads of one process) all-reduce
"I have work" only at a wave's first step and every `sync_interval` steps after, step alike
in between, and leave the wave together at the first consensus where neither has work."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from ringserve.engine.arg_utils import EngineArgs
from ringserve.engine.core.dp_wave import WaveSync
from ringserve.gpu.layers.parallel import serve_store
from ringserve.gpu.testing import tiny_model


class _Counting:
    """The gloo group, counting its all-reduces (the consensus steps)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.calls = 0

    def allreduce(self, tensors: Any) -> Any:
        self.calls += 1
        return self.group.allreduce(tensors)


def _core(rank: int, port: int, works: list[bool], out: dict[int, Any]) -> None:
    waves = WaveSync(rank, 2, port, 30.0, lambda epoch, n: None, lambda epoch, r: None,
                     sync_interval=4)
    counting = _Counting(waves._group)
    waves._group = counting
    try:
        steps = []
        assert waves.enter(True)
        for has_work in works:
            go = waves.any_work(has_work)
            steps.append(go)
            if not go:
                break
        out[rank] = (steps, counting.calls, waves.number, waves.running)
    finally:
        waves.close()


def test_consensus_every_interval_and_the_wave_ends_together() -> None:
    store = serve_store()
    store.set("ringserve/epoch", "0")
    out: dict[int, Any] = {}
    works = {0: [True] * 6 + [False] * 10, 1: [False] * 16}  # core 1 is idle all along
    threads = [threading.Thread(target=_core, args=(rank, int(store.port), works[rank], out))
               for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    # Consensus at steps 0, 4 (core 0 still has work) and 8 (neither has): the wave ends
    # there on both, after 8 steps each (core 1's were dummy passes).
    expected = ([True] * 8 + [False], 3, 1, False)
    assert out == {0: expected, 1: expected}


def test_the_flag_is_checked(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="dp_sync_interval"):
        EngineArgs(model=str(tiny_model("llama")), device="cpu",
                   dp_sync_interval=0).create_engine_config()
    config = EngineArgs(model=str(tiny_model("llama")), device="cpu").create_engine_config()
    assert config.parallel_config.dp_sync_interval == 16  # vLLM's default
