"""Two frontends over two engine cores (issue 19 items 1-2, in process): the DP coordinator
publishes every core's queue lengths to every frontend, so a frontend that never sent to
core 0 still routes around it when another frontend keeps core 0 busy, where its own books
(round-robin by what it sent) would send half of its requests there. Also: each frontend
gets exactly its own outputs; a frontend that goes away has its requests aborted by the
cores. Null model; `--disable-log-stats`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from test_dp_routing import record_choices

from ringserve import EngineArgs, RequestOutputKind, SamplingParams
from ringserve.engine.cluster.fleet import ClusterSettings, EngineFleet, build_topology
from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.engine.frontend.attached_client import AttachedMPClient, Attachment
from ringserve.engine.wire import UtilityCall

LONG = SamplingParams(max_tokens=60000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
SHORT = SamplingParams(max_tokens=2, ignore_eos=True)
NUM_LONG, NUM_SHORT = 4, 12

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def long_model_dir() -> Path:
    from ringserve.gpu.testing import tiny_model

    return tiny_model("llama", max_position_embeddings=65536)  # long requests stay running


@contextlib.asynccontextmanager
async def deployment(model: Path, tmp: Path, frontends: int = 2,
                     ) -> AsyncIterator[list[AsyncLLM]]:
    args = EngineArgs(model=str(model), device="cpu", max_model_len=65536,
                      num_gpu_blocks_override=32768, kv_cache_memory=16 << 20,
                      data_parallel_size=2, disable_log_stats=True)
    config = args.create_engine_config()
    cluster = ClusterSettings(api_server_count=frontends)
    topology = build_topology(config, cluster, str(tmp))
    fleet = EngineFleet(config, cluster, topology, executor="null")
    async with trio.open_nursery() as nursery:
        await nursery.start(fleet.run)
        try:
            async with contextlib.AsyncExitStack() as stack:
                llms = [await stack.enter_async_context(
                    AsyncLLM(config, attach=Attachment(topology, i))) for i in range(frontends)]
                yield llms
        finally:
            fleet.stop()
            nursery.cancel_scope.cancel()


def _client(llm: AsyncLLM) -> AttachedMPClient:
    assert isinstance(llm.client, AttachedMPClient)
    return llm.client


async def test_coordinator_routes_around_another_frontends_load(
        long_model_dir: Path, tmp_path: Path) -> None:
    async with deployment(long_model_dir, tmp_path) as (busy, other):
        client = _client(other)
        chosen = record_choices(client)

        async def long(i: int) -> None:
            async for _ in busy.generate({"prompt_token_ids": [5 + i] * 8}, LONG, f"long{i}",
                                         data_parallel_rank=0):
                pass

        async with trio.open_nursery() as nursery:
            for i in range(NUM_LONG):
                nursery.start_soon(long, i)
            with trio.fail_after(30):  # the other frontend learns it from the coordinator
                while client._stats[0] != [0, NUM_LONG]:
                    await trio.sleep(0.01)
            assert client.load_seq > 0
            busy_client = _client(busy)
            await busy_client.send(0, UtilityCall(next(busy_client._call_ids), "pause",
                                                  ["keep"]))
            with trio.fail_after(60):  # a short sent to core 0 would hang here
                for i in range(NUM_SHORT):
                    out = [o async for o in other.generate({"prompt_token_ids": [9] * 4},
                                                           SHORT, f"short{i}")]
                    assert out[-1].finished and len(out[-1].outputs[0].token_ids) == 2
            round_robin = [i % 2 for i in range(NUM_SHORT)]
            assert chosen == [1] * NUM_SHORT, chosen
            assert chosen.count(1) > round_robin.count(1)
            await busy_client.send(0, UtilityCall(next(busy_client._call_ids), "resume", []))
            nursery.cancel_scope.cancel()


async def test_each_frontend_gets_its_own_outputs_under_the_same_ids(
        long_model_dir: Path, tmp_path: Path) -> None:
    """Both frontends use the same request ids at once; each gets its own stream."""
    async with deployment(long_model_dir, tmp_path) as llms:
        results: dict[tuple[int, int], list[int]] = {}

        async def one(front: int, i: int) -> None:
            params = SamplingParams(max_tokens=6 + i % 3, ignore_eos=True)
            prompt = {"prompt_token_ids": [20 + front * 50 + i] * 5}
            outs = [o async for o in llms[front].generate(prompt, params, f"same-{i}")]
            assert outs[-1].request_id == f"same-{i}"
            results[front, i] = list(outs[-1].outputs[0].token_ids)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for front in range(2):
                    for i in range(20):
                        nursery.start_soon(one, front, i)
        assert len(results) == 40
        assert all(len(tokens) == 6 + i % 3 for (_, i), tokens in results.items())
        # The null model's tokens depend on the prompt: the frontends' streams differ.
        assert results[0, 0] != results[1, 0]


async def test_cores_abort_a_gone_frontends_requests(
        long_model_dir: Path, tmp_path: Path) -> None:
    async with deployment(long_model_dir, tmp_path) as (first, second):
        async def long(i: int) -> None:
            with contextlib.suppress(Exception):
                async for _ in second.generate({"prompt_token_ids": [7] * 8}, LONG, f"l{i}"):
                    pass

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(long, i)
            with trio.fail_after(30):
                while sum(s["num_running_reqs"] for s in
                          await first.call_utility("get_stats")) != 4:
                    await trio.sleep(0.05)
            # Its sockets close as they would when its process dies; it sends no abort (a
            # dead client sends nothing): the cores see the links drop.
            second.shutdown()
            with trio.fail_after(30):
                while sum(s["num_running_reqs"] for s in
                          await first.call_utility("get_stats")) != 0:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()


def test_which_deployments_scale_out(long_model_dir: Path) -> None:
    """More than one API server or engine core runs the supervisor (with a coordinator
    process for DP > 1, as vLLM), as do engines on other hosts; one of each is one process."""
    def config(dp: int) -> Any:
        return EngineArgs(model=str(long_model_dir), device="cpu", max_model_len=512,
                          data_parallel_size=dp).create_engine_config()

    assert not ClusterSettings().scaled_out(config(1))
    assert ClusterSettings(api_server_count=2).scaled_out(config(1))
    assert ClusterSettings(api_server_count=1).scaled_out(config(2))
    assert ClusterSettings(headless=True).scaled_out(config(1))
