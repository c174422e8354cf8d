"""Pause modes under live streams with two data-parallel engine cores (issue 18 item 4):
`keep` freezes every stream on every core and `resume` continues it, `abort` ends them with
finish reason abort, `wait` returns only once they have finished; a request that arrives while
paused is held and runs after `resume`. Null model (the null executor), so the steps are
fast and the test is about the engine's books."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from ringserve import EngineArgs, RequestOutputKind, SamplingParams
from ringserve.engine.frontend.async_llm import AsyncLLM

LONG = 60000  # null steps take microseconds: a stream must outlast the pause call
STREAM = SamplingParams(max_tokens=LONG, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


@pytest.fixture(scope="module")
def long_model_dir() -> Path:
    from ringserve.gpu.testing import tiny_model

    return tiny_model("llama", max_position_embeddings=65536)


def _engine(model_dir: Path) -> AsyncLLM:
    args = EngineArgs(model=str(model_dir), device="cpu", max_model_len=65536,
                      num_gpu_blocks_override=32768, kv_cache_memory=16 << 20,
                      data_parallel_size=2, disable_log_stats=True)
    return AsyncLLM.from_engine_args(args, executor="null")


class _Stream:
    """One streaming request: tokens seen so far and its finish reason."""

    def __init__(self) -> None:
        self.tokens = 0
        self.finish: str | None = None
        self.started = trio.Event()

    async def run(self, llm: AsyncLLM, rid: str, params: SamplingParams) -> None:
        async for out in llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, params,
                                      request_id=rid):
            self.tokens += len(out.outputs[0].token_ids)
            if self.tokens:
                self.started.set()
            if out.finished:
                self.finish = out.outputs[0].finish_reason


async def _start(llm: AsyncLLM, nursery: trio.Nursery, n: int,
                 params: SamplingParams = STREAM) -> list[_Stream]:
    streams = [_Stream() for _ in range(n)]
    for i, stream in enumerate(streams):
        nursery.start_soon(stream.run, llm, f"r{i}", params)
    with trio.fail_after(30):
        for stream in streams:
            await stream.started.wait()
    return streams


@pytest.mark.slow
async def test_keep_freezes_every_core_and_resume_continues(long_model_dir: Path) -> None:
    async with _engine(long_model_dir) as llm, trio.open_nursery() as nursery:
        streams = await _start(llm, nursery, 4)
        await llm.pause("keep")
        assert await llm.is_paused()
        frozen = [s.tokens for s in streams]
        await trio.sleep(0.3)
        assert [s.tokens for s in streams] == frozen  # nothing moved on either core
        assert all(s.finish is None for s in streams)
        late = _Stream()
        nursery.start_soon(late.run, llm, "late", SamplingParams(max_tokens=3, ignore_eos=True))
        await trio.sleep(0.2)
        assert late.tokens == 0  # held while paused
        await llm.resume()
        assert not await llm.is_paused()
        with trio.fail_after(30):
            while late.finish is None or any(s.tokens <= f for s, f in zip(streams, frozen,
                                                                           strict=True)):
                await trio.sleep(0.01)  # every stream moves again, and the held one ran
        await llm.pause("abort")  # the rest of the 60000 tokens is not the point
        await llm.resume()
    assert all(s.finish == "abort" for s in streams)
    assert late.finish == "length"


@pytest.mark.slow
async def test_abort_ends_every_stream_and_bad_modes_are_refused(long_model_dir: Path) -> None:
    async with _engine(long_model_dir) as llm:
        with pytest.raises(ValueError, match="allowed: abort, keep, wait"):
            await llm.pause("later")
        assert not await llm.is_paused()
        async with trio.open_nursery() as nursery:
            streams = await _start(llm, nursery, 4)
            with trio.fail_after(10):
                await llm.pause()  # vLLM's default mode: abort
        assert all(s.finish == "abort" and s.tokens < LONG for s in streams)
        await llm.resume()
        outs = [o async for o in llm.generate({"prompt_token_ids": [5, 6]},
                                              SamplingParams(max_tokens=3, ignore_eos=True))]
        assert outs[-1].outputs[0].finish_reason == "length"


@pytest.mark.slow
async def test_wait_returns_once_in_flight_requests_finish(long_model_dir: Path) -> None:
    short = SamplingParams(max_tokens=2000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    async with _engine(long_model_dir) as llm, trio.open_nursery() as nursery:
        streams = await _start(llm, nursery, 4, short)
        with trio.fail_after(30):
            await llm.pause("wait")
        assert not llm.output_processor.has_unfinished_requests()  # finished in the engine
        # Their consumers take the last outputs at their next turn (a race the test had).
        with trio.fail_after(5):
            while not all(s.finish for s in streams):
                await trio.sleep(0.005)
        assert all(s.finish == "length" and s.tokens == 2000 for s in streams)
        late = _Stream()
        nursery.start_soon(late.run, llm, "late", SamplingParams(max_tokens=3, ignore_eos=True))
        await trio.sleep(0.2)
        assert late.tokens == 0
        await llm.resume()
    assert late.finish == "length"
