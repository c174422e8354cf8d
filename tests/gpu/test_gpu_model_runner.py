"""The model runner driven by hand-built SchedulerOutputs: per-request failures (bad ids, too
many logprobs, NaN logits) leave the batch running, preemption and resume, prompt logprobs
against transformers, and the worker's lifecycle and KV sizing on CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gpu_helpers import make_runner
from runner_driver import ToyScheduler

from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.runner.model_runner import ModelRunner
from ringserve.gpu.runner.validation import validate_request
from ringserve.gpu.wire import CachedRequestData, NewRequestData, SchedulerOutput
from ringserve.gpu.worker import Worker
from ringserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> ModelRunner:
    return make_runner(tiny_llama_dir)


def _new(req_id: str, prompt: list[int], blocks: list[int], params: SamplingParams = GREEDY) -> NewRequestData:
    return NewRequestData(req_id, prompt, params, blocks, 0)


def _step(step: int, new: list[NewRequestData], sched: dict[str, int], **kw: object) -> SchedulerOutput:
    return SchedulerOutput(step, new, num_scheduled_tokens=sched,
                           total_num_scheduled_tokens=sum(sched.values()), **kw)  # type: ignore[arg-type]


def test_bad_requests_fail_alone(runner: ModelRunner) -> None:
    new = [
        _new("ok", [5, 6, 7], [1]),
        _new("bad_id", [5, 8000, 7], [2]),
        _new("too_many_logprobs", [5, 6], [3], SamplingParams(logprobs=21)),
    ]
    out = runner.execute_model(_step(0, new, {"ok": 3, "bad_id": 3, "too_many_logprobs": 2}))
    assert out.req_ids == ["ok"] and len(out.sampled_token_ids[0]) == 1
    assert "outside the vocabulary" in runner.request_errors["bad_id"]
    assert "max_logprobs" in runner.request_errors["too_many_logprobs"]
    runner.execute_model(_step(1, [], {}, finished_req_ids=["ok"]))
    assert not runner.table.requests


def test_validate_request_messages(runner: ModelRunner) -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        validate_request([], GREEDY, runner.model_config)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        validate_request([-1], GREEDY, runner.model_config)
    # The rule every layer shares (ringserve.prompt_length): room for one generated token.
    longest = runner.model_config.max_model_len - 1
    validate_request([5] * longest, GREEDY, runner.model_config)
    with pytest.raises(ValueError, match=f"at most {longest} "):
        validate_request([5] * (longest + 1), GREEDY, runner.model_config)


def test_nan_logits_fail_one_request(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    real = runner.model.compute_logits

    def poisoned(hidden: torch.Tensor) -> torch.Tensor:
        logits = real(hidden)
        logits[0, 3] = float("nan")
        return logits

    monkeypatch.setattr(runner.model, "compute_logits", poisoned)
    out = runner.execute_model(_step(0, [_new("a", [5, 6], [1]), _new("b", [7, 8], [2])], {"a": 2, "b": 2}))
    assert "NaN" in runner.request_errors["a"] and "b" not in runner.request_errors
    assert out.sampled_token_ids[0] == [] and len(out.sampled_token_ids[1]) == 1
    runner.execute_model(_step(1, [], {}, finished_req_ids=["a", "b"]))


def test_preempt_and_resume_gives_the_same_tokens(runner: ModelRunner) -> None:
    prompt = list(range(30, 45))
    out = runner.execute_model(_step(0, [_new("p", prompt, [1, 2])], {"p": 15}))
    first = out.sampled_token_ids[0][0]
    out = runner.execute_model(_step(1, [], {"p": 1}, scheduled_cached_reqs=[CachedRequestData("p", 15)]))
    second = out.sampled_token_ids[0][0]
    runner.execute_model(_step(2, [], {}, preempted_req_ids=["p"]))
    assert runner.table.slot_of("p") == -1
    resumed = CachedRequestData("p", 0, [7, 8, 9], resumed_from_preemption=True,
                                all_token_ids=[*prompt, first, second])
    out = runner.execute_model(_step(3, [], {"p": 17}, scheduled_cached_reqs=[resumed]))
    reference = ToyScheduler(runner, budget=64)
    reference.add("ref", prompt, GREEDY, 3)
    assert reference.run()["ref"] == [first, second, out.sampled_token_ids[0][0]]
    runner.execute_model(_step(4, [], {}, finished_req_ids=["p", "ref"]))


@pytest.mark.slow
def test_prompt_logprobs_match_transformers(tiny_qwen2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    runner = make_runner(tiny_qwen2_dir)
    prompt = list(range(100, 121))
    sched = ToyScheduler(runner, budget=8)
    sched.add("r", prompt, SamplingParams(temperature=0.0, prompt_logprobs=2), 1)
    sched.run()
    chunks = sched.done["r"].prompt_logprobs
    ids = np.concatenate([c.token_ids for c in chunks])
    values = np.concatenate([c.logprobs for c in chunks])
    assert ids.shape == (len(prompt) - 1, 3)
    assert ids[:, 0].tolist() == prompt[1:]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir)).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
    np.testing.assert_allclose(values, ref.gather(1, torch.from_numpy(ids).long()).numpy(), atol=1e-4)


def test_worker_lifecycle_on_cpu(tiny_mistral_dir: Path) -> None:
    config = EngineArgs(model=str(tiny_mistral_dir), device="cpu", kv_cache_memory=1 << 20,
                        block_size=16, max_model_len=128).create_engine_config()
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    spec = worker.runner.kv_spec
    assert spec.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    num_blocks = worker.determine_num_blocks()
    assert num_blocks == (1 << 20) // spec.bytes_per_block
    worker.initialize_kv_cache(num_blocks)
    out = worker.execute_model(_step(0, [_new("w", [3, 4, 5], [0])], {"w": 3}))
    assert out.req_ids == ["w"] and len(out.sampled_token_ids[0]) == 1 and not worker.request_errors
