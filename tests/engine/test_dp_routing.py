"""Least-loaded DP routing with `--disable-log-stats` (issue 14 item 5): the cores still ship
the queue lengths routing needs, so on a skewed workload (core 0 kept busy with long requests)
new requests go to the idle core, where round-robin would send half of them to the busy one.
Null model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from ringserve import EngineArgs, RequestOutputKind, SamplingParams
from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.engine.wire import UtilityCall

LONG = SamplingParams(max_tokens=60000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
SHORT = SamplingParams(max_tokens=2, ignore_eos=True)
NUM_LONG, NUM_SHORT = 4, 12


def record_choices(client: Any) -> list[int]:
    """The engines `client.choose_engine` picks from now on, in order."""
    chosen: list[int] = []
    original = client.choose_engine

    def spy(request: Any) -> int:
        engine: int = original(request)
        chosen.append(engine)
        return engine

    client.choose_engine = spy
    return chosen


@pytest.fixture(scope="module")
def long_model_dir() -> Path:
    from ringserve.gpu.testing import tiny_model

    return tiny_model("llama", max_position_embeddings=65536)


@pytest.mark.slow
async def test_least_loaded_routing_beats_round_robin_with_stats_off(
        long_model_dir: Path) -> None:
    args = EngineArgs(model=str(long_model_dir), device="cpu", max_model_len=65536,
                      num_gpu_blocks_override=32768, kv_cache_memory=16 << 20,
                      data_parallel_size=2, disable_log_stats=True)
    async with AsyncLLM.from_engine_args(args, executor="null") as llm:
        client = llm.client
        assert client is not None
        assert llm.stat_loggers is None  # stats off: nothing in the frontend is fed them
        chosen = record_choices(client)

        async def long(i: int) -> None:
            async for _ in llm.generate({"prompt_token_ids": [5 + i] * 8}, LONG, f"long{i}",
                                        data_parallel_rank=0):
                pass

        async with trio.open_nursery() as nursery:
            for i in range(NUM_LONG):
                nursery.start_soon(long, i)
            with trio.fail_after(30):  # core 0 reports its load although stats are off
                while client._stats[0] != [0, NUM_LONG]:  # type: ignore[attr-defined]
                    await trio.sleep(0.01)
            # Hold core 0's requests where they are (pause "keep", on core 0 only): its load
            # stays NUM_LONG and nothing routed to it could finish while the test runs.
            await client.send(0, UtilityCall(next(client._call_ids), "pause", ["keep"]))
            with trio.fail_after(60):  # a short sent to core 0 would hang here
                for i in range(NUM_SHORT):
                    out = [o async for o in llm.generate({"prompt_token_ids": [9] * 4}, SHORT,
                                                         f"short{i}")]
                    assert out[-1].finished and len(out[-1].outputs[0].token_ids) == 2
            least_loaded = chosen[NUM_LONG:]
            round_robin = [i % 2 for i in range(NUM_SHORT)]
            assert least_loaded == [1] * NUM_SHORT, least_loaded
            assert least_loaded.count(1) > round_robin.count(1)
            (stats,) = [s for i, s in enumerate(await llm.call_utility("get_stats")) if i == 1]
            assert stats["num_running_reqs"] == 0
            await client.send(0, UtilityCall(next(client._call_ids), "resume", []))
            nursery.cancel_scope.cancel()
        assert llm.get_metrics() == []
