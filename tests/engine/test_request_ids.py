"""Request ids and request types at the frontend edge (issue 14, items 1 and 2).

The user's id is only echoed: every request (and each child of an n > 1 request) travels under
an internal id unique to it, so a shared or child-like id can never abort, fail or receive
another request's outputs; a bad type fails at once instead of being dropped by the core.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from ringserve import EngineArgs, RequestOutputKind, SamplingParams
from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.engine.frontend.llm import LLM

LONG = SamplingParams(max_tokens=2000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


def _engine(model_dir: Path, **kw: Any) -> AsyncLLM:
    values: dict[str, Any] = {"model": str(model_dir), "device": "cpu", "max_model_len": 2048,
                              "num_gpu_blocks_override": 4096, "kv_cache_memory": 16 << 20, **kw}
    return AsyncLLM.from_engine_args(EngineArgs(**values), executor="null")


async def _drained(llm: AsyncLLM) -> dict[str, Any]:
    for _ in range(300):
        stats = (await llm.call_utility("get_stats"))[0]
        if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0:
            return dict(stats)
        await trio.sleep(0.02)
    raise AssertionError("requests still in the core")


@pytest.mark.slow
async def test_a_disconnect_never_touches_another_request_with_a_colliding_id(
        tiny_llama_dir: Path) -> None:
    """"x" with n=2 (children were "0_x", "1_x"), "0_x" itself and a second "x": cancelling
    the "0_x" stream leaves every other stream running."""
    async with _engine(tiny_llama_dir) as llm:
        counts: dict[str, int] = {"x/n2": 0, "0_x": 0, "x/again": 0}
        ids: dict[str, set[str]] = {key: set() for key in counts}
        scopes: dict[str, trio.CancelScope] = {}

        async def stream(key: str, rid: str, params: SamplingParams) -> None:
            with trio.CancelScope() as scopes[key]:
                async for out in llm.generate({"prompt_token_ids": [7] * 8}, params, rid):
                    counts[key] += 1
                    ids[key].add(out.request_id)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream, "x/n2", "x", LONG.clone(n=2))
            nursery.start_soon(stream, "0_x", "0_x", LONG)
            nursery.start_soon(stream, "x/again", "x", LONG)
            while min(counts.values()) < 3:
                await trio.sleep(0.01)
            scopes["0_x"].cancel()  # the client of "0_x" goes away
            before = dict(counts)
            while counts["x/n2"] < before["x/n2"] + 6 or counts["x/again"] < before["x/again"] + 3:
                await trio.sleep(0.01)
            assert llm.output_processor.get_num_unfinished_requests() == 3  # 2 children + 1
            nursery.cancel_scope.cancel()
        assert ids == {"x/n2": {"x"}, "0_x": {"0_x"}, "x/again": {"x"}}  # ids are echoed
        assert (await _drained(llm))["kv_cache_usage"] == 0.0
        assert not llm.output_processor.has_unfinished_requests()
        assert llm.output_processor.num_prefill_tokens == 0


@pytest.mark.slow
async def test_abort_by_id_ends_every_request_with_that_id(tiny_llama_dir: Path) -> None:
    async with _engine(tiny_llama_dir) as llm:
        finals: list[str | None] = []

        async def stream(params: SamplingParams) -> None:
            async for out in llm.generate({"prompt_token_ids": [7] * 8}, params, "shared"):
                if out.finished:
                    finals.extend(c.finish_reason for c in out.outputs)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream, LONG)
            nursery.start_soon(stream, LONG.clone(n=2))
            while llm.output_processor.get_num_unfinished_requests() < 3:
                await trio.sleep(0.01)
            await llm.abort("shared")
        assert sorted(f or "" for f in finals) == ["abort"] * len(finals) and finals
        assert (await _drained(llm))["kv_cache_usage"] == 0.0


@pytest.mark.slow
async def test_a_rejected_child_rolls_back_its_siblings_and_the_counters(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with _engine(tiny_llama_dir, max_num_queued_reqs=4) as llm:
        client = llm.client
        assert client is not None
        original = client.add_request
        sent: list[str] = []

        async def flaky(request: Any) -> None:
            if len(sent) == 2:
                raise ValueError("data_parallel_rank: refused (injected)")
            sent.append(request.request_id)
            await original(request)

        monkeypatch.setattr(client, "add_request", flaky)
        with pytest.raises(ValueError, match="injected"):
            await llm.add_request("p", {"prompt_token_ids": [5] * 30}, LONG.clone(n=4))
        processor = llm.output_processor
        assert not processor.has_unfinished_requests() and not processor.parent_requests
        assert processor.num_prefill_tokens == 0
        assert (await _drained(llm))["kv_cache_usage"] == 0.0  # the two sent were aborted
        monkeypatch.setattr(client, "add_request", original)
        outs = [o async for o in llm.generate({"prompt_token_ids": [5]},
                                              SamplingParams(n=4, max_tokens=2), "p")]
        assert outs[-1].finished  # the admission counters are whole again: 4 fit


@pytest.mark.slow
async def test_bad_types_fail_at_once_and_the_engine_keeps_serving(tiny_llama_dir: Path) -> None:
    async with _engine(tiny_llama_dir) as llm:
        cases: list[tuple[Any, Any, Any, str]] = [
            ({"prompt_token_ids": [5, 6.0]}, SamplingParams(), "r", r"prompt_token_ids\[1\]"),
            ({"prompt_token_ids": [5, True]}, SamplingParams(), "r", r"prompt_token_ids\[1\]"),
            ({"prompt_token_ids": [5], "cache_salt": 3}, SamplingParams(), "r", "cache_salt"),
            ({"prompt_token_ids": [5]}, SamplingParams(), 17, "request_id"),
            ({"prompt_token_ids": [5]}, {"max_tokens": 3}, "r", "sampling_params"),
        ]
        for prompt, params, rid, message in cases:
            with trio.fail_after(10), pytest.raises(TypeError, match=message):
                async for _ in llm.generate(prompt, params, rid):
                    pass
        with pytest.raises(ValueError, match="unknown keys"):
            await llm.add_request("r", {"prompt_token_ids": [5], "promt": "x"}, SamplingParams())
        outs = [o async for o in llm.generate({"prompt_token_ids": [5]},
                                              SamplingParams(max_tokens=3), "ok")]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        assert not llm.output_processor.has_unfinished_requests()


@pytest.mark.slow
def test_offline_bad_types_fail_at_once(tiny_llama_dir: Path) -> None:
    with LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory=16 << 20) as llm:
        with pytest.raises(TypeError, match=r"prompt_token_ids\[0\]"):
            llm.generate([{"prompt_token_ids": [5.0]}], SamplingParams(max_tokens=2),
                         use_tqdm=False)
        with pytest.raises(TypeError, match=r"SamplingParams\.max_tokens"):
            llm.generate(["hi"], SamplingParams(max_tokens=100.0), use_tqdm=False)  # type: ignore[arg-type]
        engine = llm.llm_engine
        with pytest.raises(TypeError, match="request_id"):
            engine.add_request(5, "hi", SamplingParams())  # type: ignore[arg-type]
        out = llm.generate(["hi"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
        assert not engine.has_unfinished_requests()
