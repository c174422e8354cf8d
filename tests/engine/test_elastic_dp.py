"""Elastic data parallelism (issue 19 item 5): two-phase scaling of a running AsyncLLM.

Scale 1 -> 2 -> 1 under a steady load with zero failed requests and token-exact outputs on
every core; a prepare that fails (a new core that cannot start, one that dies before the
commit) and a drain that times out leave the deployment as it was; refusals name their
reason; nothing leaks (every process started is gone at the end)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio

from ringserve import EngineArgs, SamplingParams
from ringserve.engine.cluster import elastic_dp
from ringserve.engine.cluster.elastic_dp import (
    DrainTimeoutError,
    ElasticScaleError,
    ScaleFailedError,
    ScaleInProgressError,
)
from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.engine.wire import UtilityCall

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = {"prompt_token_ids": [3, 14, 15, 92, 65, 35]}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from ringserve.gpu.testing import tiny_model

    return tiny_model("llama")


def engine_args(model: Path, **extra: Any) -> EngineArgs:
    return EngineArgs(model=str(model), device="cpu", max_model_len=256,
                      kv_cache_memory=8 << 20, **extra)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def tokens(llm: AsyncLLM, rid: str, rank: int | None = None) -> list[int]:
    final = None
    async for out in llm.generate(PROMPT, GREEDY, rid, data_parallel_rank=rank):
        final = out
    assert final is not None and final.finished
    return list(final.outputs[0].token_ids)


@pytest.mark.slow
async def test_scale_up_and_down_under_load_loses_nothing(model_dir: Path) -> None:
    async with AsyncLLM.from_engine_args(engine_args(model_dir)) as llm:
        reference = await tokens(llm, "ref")
        assert len(reference) == 8
        results: list[list[int]] = []
        failures: list[BaseException] = []
        stop = trio.Event()

        async def load(worker: int) -> None:
            i = 0
            while not stop.is_set():
                try:
                    results.append(await tokens(llm, f"w{worker}-{i}"))
                except Exception as exc:  # every failure is counted, none expected
                    failures.append(exc)
                i += 1

        async with trio.open_nursery() as nursery:
            for worker in range(4):
                nursery.start_soon(load, worker)
            await trio.sleep(0.5)
            await llm.prepare_elastic_dp(2)
            assert llm.is_scaling_elastic_dp and llm.data_parallel_size == 1
            client: Any = llm.client
            new_pid = client.pending[0].pid
            assert client.routable == 1  # prepared, not routed to
            await llm.commit_elastic_dp()
            assert not llm.is_scaling_elastic_dp
            assert llm.data_parallel_size == 2 and client.num_engines == 2
            # The new core serves, token-exact with the first one.
            assert await tokens(llm, "on-new", rank=1) == reference
            await trio.sleep(0.5)
            served_before = len(results)
            await llm.scale_elastic_dp(1, drain_timeout=60)
            assert llm.data_parallel_size == 1 and client.num_engines == 1
            with trio.fail_after(15):
                while alive(new_pid):
                    await trio.sleep(0.05)
            await trio.sleep(0.3)
            stop.set()
        assert not failures, failures[:3]
        assert len(results) > served_before > 4
        assert all(r == reference for r in results)
        with pytest.raises(ValueError, match="data_parallel_rank"):
            await tokens(llm, "gone", rank=1)
        assert llm.is_running


@pytest.mark.slow
async def test_failed_prepare_and_drain_timeout_roll_back(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with AsyncLLM.from_engine_args(engine_args(model_dir)) as llm:
        client: Any = llm.client
        # A new core that cannot start (its model directory does not exist).
        broken = elastic_dp.resized

        def bad_config(config: Any, size: int) -> Any:
            resized = broken(config, size)
            model = elastic_dp.dataclasses.replace(resized.model_config,
                                                   weights_path="/nonexistent/weights")
            return elastic_dp.dataclasses.replace(resized, model_config=model)

        monkeypatch.setattr(elastic_dp, "resized", bad_config)
        with pytest.raises(ScaleFailedError, match="stays at 1"):
            await llm.prepare_elastic_dp(2)
        monkeypatch.setattr(elastic_dp, "resized", broken)
        assert client.num_engines == 1 and not client.pending
        assert not llm.is_scaling_elastic_dp
        assert len(await tokens(llm, "after-failed-prepare")) == 8

        # A prepared core that dies before the commit.
        await llm.prepare_elastic_dp(2)
        proc = client.pending[0]
        proc.proc.kill()
        with trio.fail_after(10):
            while not proc.exited.is_set():
                await trio.sleep(0.02)
        with pytest.raises(ScaleFailedError, match="after it was prepared"):
            await llm.commit_elastic_dp()
        assert client.num_engines == 1 and not llm.is_scaling_elastic_dp

        # A drain that takes too long: a long request holds core 1.
        await llm.scale_elastic_dp(2)
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        async with trio.open_nursery() as nursery:
            done: list[int] = []

            async def hold() -> None:
                async for out in llm.generate(PROMPT, long, "long", data_parallel_rank=1):
                    if out.finished:
                        done.append(len(out.outputs[0].token_ids))

            nursery.start_soon(hold)
            with trio.fail_after(30):
                while client.owned_from(1) == 0:
                    await trio.sleep(0.01)
            await llm.prepare_elastic_dp(1)
            # Core 1 alone pauses ("keep"): its request stays in flight until it resumes.
            await client.send(1, UtilityCall(next(client._call_ids), "pause", ["keep"]))
            with pytest.raises(DrainTimeoutError, match="rolled back"):
                await llm.commit_elastic_dp(drain_timeout=0.3)
            assert client.num_engines == 2 and client.routable == 2
            await client.send(1, UtilityCall(next(client._call_ids), "resume", []))
            assert len(await tokens(llm, "back-on-1", rank=1)) == 8
        assert done == [200]  # the long request was not lost
        pids = [p.pid for p in client.processes]
        await llm.scale_elastic_dp(1)
        with trio.fail_after(15):
            while alive(pids[1]):
                await trio.sleep(0.05)


async def test_refusals_name_their_reason(model_dir: Path) -> None:
    async with AsyncLLM.from_engine_args(engine_args(model_dir), executor="null") as llm:
        for bad in (0, -1, True, "2", 2.0, 10**6):
            with pytest.raises(ElasticScaleError, match="new_data_parallel_size"):
                await llm.prepare_elastic_dp(bad)  # type: ignore[arg-type]
        with pytest.raises(ElasticScaleError, match="no scale is prepared"):
            await llm.commit_elastic_dp()
        for bad_timeout in (0, -1, float("nan"), float("inf"), "5"):
            with pytest.raises(ElasticScaleError, match="drain_timeout"):
                await llm.scale_elastic_dp(2, drain_timeout=bad_timeout)  # type: ignore[arg-type]
        await llm.pause("keep")
        with pytest.raises(ElasticScaleError, match="paused"):
            await llm.prepare_elastic_dp(2)
        await llm.resume()
        await llm.prepare_elastic_dp(1)  # the current size: a no-op scale
        with pytest.raises(ScaleInProgressError, match="prepared"):
            await llm.prepare_elastic_dp(2)
        await llm.commit_elastic_dp()
        # A prepared scale-up that is cancelled stops its core.
        await llm.prepare_elastic_dp(2)
        client: Any = llm.client
        proc = client.pending[0]
        await llm.cancel_elastic_dp()
        assert proc.exited.is_set() and not client.pending and client.num_engines == 1
        assert not llm.is_scaling_elastic_dp


async def test_expert_parallel_and_weight_transfer_are_refused(model_dir: Path) -> None:
    args = engine_args(model_dir, weight_transfer_config={"backend": "shm"})
    async with AsyncLLM.from_engine_args(args, executor="null") as llm:
        with pytest.raises(ElasticScaleError, match="weight-transfer-config"):
            await llm.prepare_elastic_dp(2)


async def test_a_frontend_with_engines_on_other_hosts_refuses(model_dir: Path) -> None:
    from ringserve.engine.cluster.wire import ClusterTopology
    from ringserve.engine.frontend.attached_client import Attachment

    config = engine_args(model_dir).create_engine_config()
    llm = AsyncLLM(config, attach=Attachment(ClusterTopology(frontends=[]), 0))
    with pytest.raises(ElasticScaleError, match="other hosts"):
        await llm.prepare_elastic_dp(2)
