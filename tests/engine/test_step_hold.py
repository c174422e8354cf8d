"""A pause skips the steps already queued for the worker (`ringserve.gpu.executor.step_hold`):
with the in-process and the multiprocess executor, greedy streams paused (keep) and resumed
again and again give the tokens of an unpaused run, constrained ones included, and some steps
were skipped; after an abort the prefix cache serves no block a skipped step would have
written; TP > 1 and lockstep deployments never skip."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from ringserve import EngineArgs, RequestOutputKind, SamplingParams, StructuredOutputsParams
from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.gpu.executor.step_hold import steps_may_be_skipped

pytestmark = pytest.mark.slow

# Two share a 24-token prefix (prefix-cache hits inside skipped steps); the last is constrained.
PROMPTS = [[7] * 24 + [40, 41], [7] * 24 + [50], [300, 301, 302, 303, 304], [900, 901, 902]]
MAX_TOKENS = 160


def _params(index: int) -> SamplingParams:
    constraint = (StructuredOutputsParams(regex=r"[a-z]{1,150}")
                  if index == len(PROMPTS) - 1 else None)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA, structured_outputs=constraint)


def _engine(model_dir: Path, executor: str) -> AsyncLLM:
    args = EngineArgs(model=str(model_dir), device="cpu", kv_cache_memory=16 << 20,
                      max_model_len=512, max_num_batched_tokens=16, max_num_seqs=8,
                      distributed_executor_backend=executor, disable_log_stats=True)
    return AsyncLLM.from_engine_args(args)


async def _stream(llm: AsyncLLM, rid: str, index: int, tokens: dict[str, list[int]],
                  finish: dict[str, str | None]) -> None:
    got = tokens.setdefault(rid, [])
    async for out in llm.generate({"prompt_token_ids": PROMPTS[index]}, _params(index),
                                  request_id=rid):
        got.extend(out.outputs[0].token_ids)
        if out.finished:
            finish[rid] = out.outputs[0].finish_reason


async def _skipped(llm: AsyncLLM) -> float:
    return sum(t["skipped"] for t in await llm.call_utility("get_step_timings"))


async def _run(llm: AsyncLLM, tag: str, pause: bool) -> tuple[list[list[int]], int, float]:
    """Every prompt streamed at once; with `pause`, paused (keep) and resumed again and
    again while they run. Returns the tokens, the number of pauses and of skipped steps."""
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    ids = [f"{tag}{i}" for i in range(len(PROMPTS))]
    pauses, skipped = 0, 0.0
    await _skipped(llm)  # from zero
    async with trio.open_nursery() as nursery:
        for i, rid in enumerate(ids):
            nursery.start_soon(_stream, llm, rid, i, tokens, finish)
        if pause:
            with trio.fail_after(120):
                while len(finish) < len(ids):
                    seen = sum(len(t) for t in tokens.values())
                    while sum(len(t) for t in tokens.values()) == seen and len(finish) < len(ids):
                        await trio.sleep(0.001)  # steps are running again
                    await llm.pause("keep")
                    pauses += 1
                    await trio.sleep(0.02)  # outputs sent before the pause's answer land
                    frozen = [len(tokens.get(rid, [])) for rid in ids]
                    await trio.sleep(0.01)
                    assert [len(tokens.get(rid, [])) for rid in ids] == frozen
                    skipped += await _skipped(llm)
                    await llm.resume()
    assert all(finish[rid] == "length" for rid in ids), finish
    return [tokens[rid] for rid in ids], pauses, skipped


@pytest.mark.parametrize("executor", ["uni", "mp"])
async def test_keep_pauses_skip_queued_steps_and_tokens_match(tiny_llama_dir: Path,
                                                              executor: str) -> None:
    async with _engine(tiny_llama_dir, executor) as llm:
        want, _, _ = await _run(llm, "ref", pause=False)
        got, pauses, skipped = await _run(llm, "held", pause=True)
    assert all(len(t) == MAX_TOKENS for t in want)
    assert got == want
    # The queued step of a pause that comes mid-step is skipped, not run: with dozens of
    # pauses over a few hundred steps some certainly came mid-step.
    assert pauses >= 20 and skipped > 0, (pauses, skipped)


async def test_abort_leaves_no_unwritten_block_in_the_prefix_cache(tiny_llama_dir: Path,
                                                                   ) -> None:
    async with _engine(tiny_llama_dir, "uni") as llm:
        want, _, _ = await _run(llm, "ref", pause=False)
        for attempt in range(3):
            tokens: dict[str, list[int]] = {}
            finish: dict[str, str | None] = {}
            async with trio.open_nursery() as nursery:
                for i in range(len(PROMPTS)):
                    nursery.start_soon(_stream, llm, f"a{attempt}-{i}", i, tokens, finish)
                with trio.fail_after(60):
                    while sum(len(t) for t in tokens.values()) < 8 * (attempt + 1):
                        await trio.sleep(0.001)
                await llm.pause("abort")
            assert set(finish.values()) == {"abort"}
            await llm.resume()
            stats = (await llm.call_utility("get_stats"))[0]
            assert stats["kv_cache_usage"] == 0.0  # every block free (prefixes stay cached)
        # The same prompts hit the prefix cache the aborted ones filled: the same tokens.
        again, _, _ = await _run(llm, "again", pause=False)
        assert again == want
        # Aborts in the middle of long prefills (16 tokens a step): a prompt's blocks that a
        # skipped step would have filled are not served to the next request with it (one
        # that is gives other tokens than the same prompt computed afresh, at least when its
        # stale contents matter; the scheduler's random test checks every block).
        greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for attempt in range(12):
            prompt = {"prompt_token_ids": [1000 + 10 * attempt + i % 7 for i in range(200)]}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_drain, llm, prompt, greedy, f"long{attempt}")
                await trio.sleep(0.0025 * (attempt + 1))
                await llm.pause("abort")
            await llm.resume()
            cached = await _final(llm, prompt, greedy, f"hit{attempt}")
            assert (await llm.call_utility("reset_prefix_cache")) == [True]
            assert await _final(llm, prompt, greedy, f"fresh{attempt}") == cached


async def _drain(llm: AsyncLLM, prompt: dict[str, list[int]], params: SamplingParams,
                 rid: str) -> None:
    async for _ in llm.generate(prompt, params, request_id=rid):
        pass


async def _final(llm: AsyncLLM, prompt: dict[str, list[int]], params: SamplingParams,
                 rid: str) -> list[int]:
    outs = [out async for out in llm.generate(prompt, params, request_id=rid)]
    assert outs[-1].outputs[0].finish_reason == "length"
    return list(outs[-1].outputs[0].token_ids)


def test_tp_and_lockstep_deployments_never_skip(tiny_llama_dir: Path) -> None:
    def config(**kw: object) -> object:
        return EngineArgs(model=str(tiny_llama_dir), device="cpu", **kw).create_engine_config()

    assert steps_may_be_skipped(config())  # type: ignore[arg-type]
    assert not steps_may_be_skipped(config(tensor_parallel_size=2))  # type: ignore[arg-type]
