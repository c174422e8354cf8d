"""EngineCore + InprocClient + LLMEngine over the null-model executor (no model compute)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringserve import EngineArgs, SamplingParams
from ringserve.config import EngineConfig
from ringserve.engine.frontend.llm_engine import LLMEngine
from ringserve.gpu.executor.null import NullExecutor


def _config(model_dir: Path, **kw: object) -> EngineConfig:
    values: dict[str, object] = {"model": str(model_dir), "device": "cpu", "max_model_len": 256,
                                 "num_gpu_blocks_override": 64, **kw}
    return EngineArgs(**values).create_engine_config()  # type: ignore[arg-type]


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def _assert_all_free(engine: LLMEngine) -> None:
    core = engine.engine_core.core  # type: ignore[attr-defined]
    for _ in range(100):  # the busy loop would go on stepping: in-flight steps, finished ids
        if not core.has_work():
            break
        engine.engine_core.get_output()
    assert not core.scheduler.has_requests() and not core.batch_queue
    assert core.scheduler.make_stats().kv_cache_usage == 0.0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_requests_run_to_max_tokens(tiny_llama_dir: Path, async_scheduling: bool) -> None:
    engine = LLMEngine(_config(tiny_llama_dir, async_scheduling=async_scheduling),
                       executor_class=NullExecutor)
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    for i in range(5):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(5, 5 + 10 * (i + 1)))}, params)
    done = _run(engine)
    assert sorted(done) == [f"r{i}" for i in range(5)]
    assert all(len(ids) == 7 for ids in done.values())
    _assert_all_free(engine)
    engine.shutdown()


def test_async_and_sync_scheduling_agree(tiny_llama_dir: Path) -> None:
    results = []
    for flag in (True, False):
        engine = LLMEngine(_config(tiny_llama_dir, async_scheduling=flag), executor_class=NullExecutor)
        for i in range(6):
            engine.add_request(f"r{i}", {"prompt_token_ids": [7] * (3 + 17 * i)},
                               SamplingParams(max_tokens=5 + i, ignore_eos=True))
        results.append(_run(engine))
        engine.shutdown()
    assert results[0] == results[1]


def test_abort_mid_generation_frees_blocks(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(_config(tiny_llama_dir), executor_class=NullExecutor)
    engine.add_request("a", {"prompt_token_ids": [9] * 40}, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": [9] * 40}, SamplingParams(max_tokens=10, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request(["a"])
    done = _run(engine)
    assert "a" not in done and len(done["b"]) == 10
    _assert_all_free(engine)
    engine.shutdown()


def test_n_greater_than_one_fans_out(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(_config(tiny_llama_dir), executor_class=NullExecutor)
    engine.add_request("p", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert len(finals) == 1 and [c.index for c in finals[0].outputs] == [0, 1, 2]
    engine.shutdown()


def test_invalid_request_raises_and_engine_keeps_serving(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(_config(tiny_llama_dir), executor_class=NullExecutor)
    with pytest.raises(ValueError, match="max_model_len is 256"):
        engine.add_request("long", {"prompt_token_ids": [5] * 300}, SamplingParams())
    engine.add_request("ok", {"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(_run(engine)["ok"]) == 2
    engine.shutdown()


def test_utilities_pause_resume_and_weight_version(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(_config(tiny_llama_dir), executor_class=NullExecutor)
    assert engine.call_utility("ping") == "pong"
    engine.call_utility("set_weight_version", "v2")
    assert engine.call_utility("get_weight_version") == "v2"
    assert engine.call_utility("get_num_blocks") == 64
    engine.call_utility("pause", "keep")
    engine.add_request("held", {"prompt_token_ids": [5] * 4}, SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.step() == [] and engine.call_utility("is_paused")
    engine.call_utility("resume")
    assert len(_run(engine)["held"]) == 2
    with pytest.raises(ValueError, match="unknown utility method 'rm_rf'"):
        engine.call_utility("rm_rf")
    with pytest.raises(ValueError, match="pause mode"):
        engine.call_utility("pause", "sideways")
    assert engine.call_utility("reset_prefix_cache") is True
    engine.shutdown()


def test_sleep_and_wake_up(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(_config(tiny_llama_dir), executor_class=NullExecutor)
    engine.add_request("busy", {"prompt_token_ids": [5] * 4}, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match="1 requests are in flight"):
        engine.call_utility("sleep", 1)
    engine.abort_request(["busy"])
    engine.call_utility("sleep", 2)
    assert engine.call_utility("is_sleeping") == 2
    engine.add_request("later", {"prompt_token_ids": [5] * 4}, SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.step() == []  # held while asleep
    engine.call_utility("wake_up")
    assert len(_run(engine)["later"]) == 2
    with pytest.raises(ValueError, match="sleep level"):
        engine.call_utility("sleep", 3)
    engine.shutdown()


def test_hold_new_requests_for_a_lockstep_sleep(tiny_llama_dir: Path) -> None:
    """The cores of a lockstep deployment agree on a sleep: each holds new requests and says
    how many are in flight (those go on); releasing queues the held ones."""
    engine = LLMEngine(_config(tiny_llama_dir), executor_class=NullExecutor)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("busy", {"prompt_token_ids": [5] * 4}, params)
    assert engine.call_utility("hold_new_requests") == 1
    engine.add_request("held", {"prompt_token_ids": [6] * 4}, params)
    assert set(_run(engine)) == {"busy"}  # the one in flight finished; the new one waits
    assert engine.call_utility("hold_new_requests") == 0
    engine.call_utility("release_new_requests")
    assert len(_run(engine)["held"]) == 2
    engine.call_utility("hold_new_requests")
    engine.call_utility("sleep", 2)
    engine.call_utility("release_new_requests")  # asleep: still held until the wake-up
    engine.add_request("later", {"prompt_token_ids": [7] * 4}, params)
    assert engine.step() == []
    engine.call_utility("wake_up")
    assert len(_run(engine)["later"]) == 2
    engine.shutdown()
