"""AsyncLLM on trio: streaming kinds, n > 1, cancel -> abort, admission limits, data-parallel
routing, engine death and chunked output handling (null model unless a test needs tokens)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from ringserve import EngineArgs, RequestOutputKind, SamplingParams
from ringserve.engine.errors import EngineDeadError, MaxQueuedTokensError, QueueOverflowError
from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.engine.frontend.output_processor import OutputProcessor

LONG = SamplingParams(max_tokens=2000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


def _engine(model_dir: Path, executor: str = "null", **kw: Any) -> AsyncLLM:
    values: dict[str, Any] = {"model": str(model_dir), "device": "cpu", "max_model_len": 2048,
                              "num_gpu_blocks_override": 4096, "kv_cache_memory": 16 << 20, **kw}
    return AsyncLLM.from_engine_args(EngineArgs(**values), executor=executor)


async def _drained(llm: AsyncLLM) -> dict[str, Any]:
    for _ in range(200):
        stats = (await llm.call_utility("get_stats"))[0]
        if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0:
            return dict(stats)
        await trio.sleep(0.02)
    raise AssertionError("requests still in the core")


@pytest.mark.slow
async def test_streams_match_and_n_merges(tiny_llama_dir: Path) -> None:
    greedy = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
    async with _engine(tiny_llama_dir, executor="default") as llm:
        deltas = [o async for o in llm.generate(
            "Hello there", SamplingParams(**greedy, output_kind=RequestOutputKind.DELTA))]
        cumulative = [o async for o in llm.generate("Hello there", SamplingParams(**greedy))]
        final = [o async for o in llm.generate(
            "Hello there", SamplingParams(**greedy, output_kind=RequestOutputKind.FINAL_ONLY))]
        fanned = [o async for o in llm.generate(
            "Hi", SamplingParams(n=3, seed=5, max_tokens=6, ignore_eos=True,
                                 output_kind=RequestOutputKind.FINAL_ONLY))]
    text = cumulative[-1].outputs[0].text
    assert "".join(o.outputs[0].text for o in deltas) == text
    assert sum(len(o.outputs[0].token_ids) for o in deltas) == 10
    assert len(final) == 1 and final[0].outputs[0].text == text and final[0].finished
    assert len(fanned) == 1 and [c.index for c in fanned[0].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in fanned[0].outputs)


@pytest.mark.slow
async def test_cancel_aborts_in_core_and_abort_ends_stream(tiny_llama_dir: Path) -> None:
    async with _engine(tiny_llama_dir) as llm:
        with trio.move_on_after(10) as scope:
            count = 0
            async for _ in llm.generate({"prompt_token_ids": [5] * 8}, LONG, "victim"):
                count += 1
                if count == 3:
                    scope.cancel()
        assert scope.cancelled_caught
        stats = await _drained(llm)
        assert stats["kv_cache_usage"] == 0.0

        outputs: list[Any] = []

        async def consume() -> None:
            async for out in llm.generate({"prompt_token_ids": [6] * 8}, LONG, "aborted"):
                outputs.append(out)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            while len(outputs) < 2:
                await trio.sleep(0.01)
            await llm.abort("aborted")
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        assert (await _drained(llm))["kv_cache_usage"] == 0.0


@pytest.mark.slow
async def test_admission_limits(tiny_llama_dir: Path) -> None:
    async with _engine(tiny_llama_dir, max_num_queued_reqs=3, max_num_queued_tokens=100) as llm:
        await llm.call_utility("pause", "keep")  # requests stay in flight, deterministically
        await llm.add_request("a", {"prompt_token_ids": [5] * 40}, LONG)
        with pytest.raises(QueueOverflowError, match="max_num_queued_reqs is 3"):
            await llm.add_request("n", {"prompt_token_ids": [5]}, SamplingParams(n=3))
        with pytest.raises(MaxQueuedTokensError, match="max_num_queued_tokens is 100"):
            await llm.add_request("b", {"prompt_token_ids": [5] * 61}, LONG)
        await llm.add_request("c", {"prompt_token_ids": [5] * 60}, LONG)
        with pytest.raises(QueueOverflowError):
            await llm.add_request("d", {"prompt_token_ids": [5]}, SamplingParams(n=2))
        await llm.abort(["a", "c"])
        await llm.call_utility("resume")
        outs = [o async for o in llm.generate({"prompt_token_ids": [5]},
                                              SamplingParams(n=3, max_tokens=2))]
        assert outs[-1].finished  # admission recovers once requests leave
        assert (await _drained(llm))["kv_cache_usage"] == 0.0


@pytest.mark.slow
async def test_data_parallel_spreads_requests(tiny_llama_dir: Path) -> None:
    async with _engine(tiny_llama_dir, data_parallel_size=2) as llm:
        client = llm.client
        assert client is not None
        chosen: list[int] = []
        original = client.choose_engine

        def spy(request: Any) -> int:
            engine = original(request)
            chosen.append(engine)
            return engine

        client.choose_engine = spy  # type: ignore[method-assign]

        async def one(i: int) -> None:
            params = SamplingParams(max_tokens=20 + i % 7, ignore_eos=True)
            async for _ in llm.generate({"prompt_token_ids": [5 + i] * 16}, params, f"r{i}"):
                pass

        async with trio.open_nursery() as nursery:
            for i in range(100):
                nursery.start_soon(one, i)
        assert 40 <= chosen.count(0) <= 60 and len(chosen) == 100
        assert len(await llm.call_utility("ping")) == 2


@pytest.mark.slow
async def test_dead_core_fails_pending_and_new_requests(tiny_llama_dir: Path) -> None:
    # Without fault tolerance a core death ends the engine (with it, the core is restarted:
    # test_fault_tolerance.py).
    async with _engine(tiny_llama_dir, enable_fault_tolerance=False) as llm:
        client = llm.client
        assert client is not None
        killed = False
        with pytest.raises(EngineDeadError):
            async for out in llm.generate({"prompt_token_ids": [5] * 4}, LONG):
                if out.outputs[0].token_ids and not killed:  # outputs already queued still come
                    os.kill(client.processes[0].pid, signal.SIGKILL)
                    killed = True
        with pytest.raises(EngineDeadError, match="killed by signal SIGKILL"):
            await llm.add_request("late", {"prompt_token_ids": [5]}, SamplingParams())
        assert llm.errored


@pytest.mark.slow
async def test_thousand_streams_are_processed_in_bounded_chunks(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler never folds more than one chunk of outputs between two checkpoints."""
    monkeypatch.setenv("RINGSERVE_OUTPUT_PROC_CHUNK_SIZE", "64")
    largest_run = 0
    current = 0
    original = OutputProcessor.process_outputs

    def counting(self: OutputProcessor, outputs: list[Any], *rest: Any) -> Any:
        nonlocal current, largest_run
        current += len(outputs)
        largest_run = max(largest_run, current)
        return original(self, outputs, *rest)

    class ResetOnYield(trio.abc.Instrument):
        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            nonlocal current
            current = 0

    monkeypatch.setattr(OutputProcessor, "process_outputs", counting)
    trio.lowlevel.add_instrument(ResetOnYield())
    async with _engine(tiny_llama_dir, max_num_seqs=1024, max_num_batched_tokens=16384) as llm:
        finished = 0

        async def one(i: int) -> None:
            nonlocal finished
            params = SamplingParams(max_tokens=5, ignore_eos=True)
            outs = [o async for o in llm.generate({"prompt_token_ids": [5 + i % 50] * 4}, params)]
            finished += outs[-1].finished

        # Held while all 1000 arrive, so the first step's batch holds every one of them
        # (without this, batch sizes depend on how fast requests trickle in).
        await llm.call_utility("pause", "keep")
        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(one, i)
            while llm.output_processor.get_num_unfinished_requests() < 1000:
                await trio.sleep(0.01)
            await llm.call_utility("resume")
    assert finished == 1000
    assert 64 <= largest_run <= 64
