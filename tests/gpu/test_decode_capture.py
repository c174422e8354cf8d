"""The captured decode step (`ringserve.gpu.runner.decode_capture`, the fused C step on CPU) against
the eager model: token for token and logprob for logprob, for every family the C step covers,
at every batch size of a ladder and the sizes between (a request mix that shrinks across the
ladder mid-stream, and starts above its top so the first steps run eagerly); which models and
settings run eagerly, and why; and a bad schedule failing without running the step."""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from runner_driver import ToyScheduler

from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.runner.input_prep import prepare_inputs
from ringserve.gpu.runner.model_runner import ModelRunner
from ringserve.gpu.testing import tiny_model
from ringserve.sampling_params import SamplingParams

LADDER = [1, 2, 4, 8]
# Llama, Mistral, Qwen2 (qkv bias, tied), Qwen3 (q/k norm), Phi-3 (sliding window 8),
# Phi-4-mini (partial rotary, longrope), and the mixtures of experts without a shared expert:
# Qwen3-MoE (a dense layer among the sparse ones, renormalised top-2), Mixtral, Qwen2-MoE (a
# gated shared expert, top-2 not renormalised).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "phi4mini", "qwen3moe", "mixtral",
            "qwen2moe")


def _runner(model: Path, *, enforce_eager: bool = False, quantization: str | None = None,
            backend: str = "cpu", sizes: list[int] | None = None) -> ModelRunner:
    config = EngineArgs(
        model=str(model), block_size=8, max_num_seqs=16, max_model_len=256, device="cpu",
        enforce_eager=enforce_eager, cuda_graph_sizes=sizes or LADDER,
        quantization=quantization,
    ).create_engine_config()
    runner = ModelRunner(config, torch.device("cpu"), attention_backend=backend)  # type: ignore[arg-type]
    runner.load_model()
    runner.initialize_kv_cache(256)
    return runner


def _mix(runner: ModelRunner, num: int = 11) -> tuple[dict[str, list[int]], dict[str, np.ndarray]]:
    """`num` greedy requests with staggered lengths: the batch starts above the ladder's top
    and shrinks through every size below it as they finish."""
    gen = torch.Generator().manual_seed(1)
    sched = ToyScheduler(runner, budget=48)
    for i in range(num):
        prompt = torch.randint(3, 8000, (3 + 5 * i % 23,), generator=gen).tolist()
        tokens = 2 + 3 * i
        params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, logprobs=2)
        sched.add(f"r{i}", prompt, params, tokens)
    out = sched.run()
    logprobs = {r: np.concatenate([lp.logprobs for lp in req.logprobs])
                for r, req in sched.done.items()}
    return out, logprobs


def _steps_by_path(runner: ModelRunner) -> dict[str, set[int]]:
    """Wrap the runner so each decode batch size is recorded under the path that ran it."""
    seen: dict[str, set[int]] = {"captured": set(), "eager": set()}
    capture = runner.capture
    assert capture is not None
    run, forward = capture.run_keeping, runner.model.forward

    def captured(inputs, abort_flag, layers, row_slots=None):  # type: ignore[no-untyped-def]
        seen["captured"].add(len(inputs.req_ids))
        return run(inputs, abort_flag, layers, row_slots)

    def eager(input_ids, positions, caches, meta):  # type: ignore[no-untyped-def]
        if meta.max_query_len == 1:
            seen["eager"].add(len(meta.seq_lens_cpu))
        return forward(input_ids, positions, caches, meta)

    capture.run_keeping = captured  # type: ignore[method-assign]
    runner.model.forward = eager  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_steps_equal_eager_steps_across_the_ladder(family: str) -> None:
    model = tiny_model(family)
    eager_runner = _runner(model, enforce_eager=True)
    assert eager_runner.capture is None and eager_runner.capture_reason == "--enforce-eager"
    expected, expected_lp = _mix(eager_runner)
    runner = _runner(model)
    assert runner.capture is not None, runner.capture_reason
    seen = _steps_by_path(runner)
    got, got_lp = _mix(runner)
    assert got == expected
    for req_id, lp in expected_lp.items():
        np.testing.assert_allclose(got_lp[req_id], lp, atol=2e-4, rtol=0)
    # Every size from 8 down to 1 ran captured, the ladder's and the padded ones (3, 5-7);
    # above the top of the ladder the steps ran eagerly.
    assert set(range(1, 9)) <= seen["captured"]
    assert seen["eager"] and min(seen["eager"]) > LADDER[-1]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_captured_steps_read_quantized_panels_as_the_eager_layers_do(quantization: str) -> None:
    model = tiny_model("qwen2")  # qkv bias: folded into the int8 / int4 panels
    expected, expected_lp = _mix(_runner(model, enforce_eager=True, quantization=quantization))
    runner = _runner(model, quantization=quantization)
    assert runner.capture is not None and runner.capture.info.weight_formats == (quantization,)
    got, got_lp = _mix(runner)
    assert got == expected
    for req_id, lp in expected_lp.items():
        np.testing.assert_allclose(got_lp[req_id], lp, atol=2e-4, rtol=0)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_captured_moe_steps_read_quantized_experts(quantization: str) -> None:
    model = tiny_model("qwen3moe")
    expected, expected_lp = _mix(_runner(model, enforce_eager=True, quantization=quantization))
    runner = _runner(model, quantization=quantization)
    assert runner.capture is not None, runner.capture_reason
    got, got_lp = _mix(runner)
    assert got == expected
    for req_id, lp in expected_lp.items():
        np.testing.assert_allclose(got_lp[req_id], lp, atol=2e-4, rtol=0)


def test_gemma_and_the_torch_backend_run_eagerly_with_a_reason() -> None:
    gemma = _runner(tiny_model("gemma2"))
    assert gemma.capture is None and "own layer structure" in gemma.capture_reason
    torch_backend = _runner(tiny_model("llama"), backend="torch")
    assert torch_backend.capture is None and "torch attention backend" in torch_backend.capture_reason


def test_a_runner_recaptures_after_sleep_and_wake() -> None:
    runner = _runner(tiny_model("llama"))
    before = runner.capture
    runner.release_kv_cache()
    assert runner.capture is None
    runner.initialize_kv_cache(256)
    assert runner.capture is not None and runner.capture is not before
    runner.release_model()
    assert runner.capture is None


def test_a_slot_outside_the_cache_raises_before_the_step_runs() -> None:
    runner = _runner(tiny_model("llama"))
    sched = ToyScheduler(runner, budget=48)
    sched.add("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3), 3)
    sched.step()  # the prefill; the request now decodes
    inputs = prepare_inputs(runner.table, ["a"], np.ones(1, dtype=np.int32), runner.device)
    assert runner.capture is not None and runner.capture.accepts(inputs)
    cache = runner.kv_caches[0].clone()
    bad = dataclasses.replace(inputs.meta, slot_mapping=torch.tensor([10**9]))
    with pytest.raises(ValueError, match="out of range"):
        runner.capture.run(dataclasses.replace(inputs, meta=bad))
    assert torch.equal(runner.kv_caches[0], cache)  # nothing was written


def test_cuda_graph_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineArgs(cuda_graph_sizes=[4, 2]).create_engine_config()
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineArgs(cuda_graph_sizes=[0]).create_engine_config()


def test_a_raised_abort_flag_ends_the_step_and_its_rerun_is_unchanged() -> None:
    """The step-hold byte (`ringserve.gpu.executor.step_hold`) ends a captured step between
    two layers; the step run again over the KV the ended one half wrote gives the same
    tokens and logprobs as steps that were never ended."""
    from ringserve.gpu.runner.decode_capture import StepAborted

    model = tiny_model("llama")
    want = _mix(_runner(model))
    runner = _runner(model)
    capture = runner.capture
    assert capture is not None
    run = capture.run_keeping
    up, down = ctypes.c_ubyte(1), ctypes.c_ubyte(0)
    ended = []

    def ending(inputs, abort_flag, layers, row_slots=None):  # type: ignore[no-untyped-def]
        with pytest.raises(StepAborted):
            run(inputs, ctypes.addressof(up), layers, row_slots)
        ended.append(len(inputs.req_ids))
        return run(inputs, ctypes.addressof(down), layers, row_slots)

    capture.run_keeping = ending  # type: ignore[method-assign]
    got = _mix(runner)
    assert ended
    assert got[0] == want[0]
    for rid, logprobs in want[1].items():
        np.testing.assert_array_equal(got[1][rid], logprobs)


def test_a_raised_abort_flag_ends_an_eager_step_between_layers() -> None:
    """An eager step (prefill chunks, mixed batches) ends at the next layer too when the
    step-hold byte is up (issue 45, item 5): the runner answers it as skipped, and the step run
    again over the KV the ended one half wrote gives unchanged tokens and logprobs."""
    from ringserve.gpu.runner.decode_capture import StepAborted, abort_check

    model = tiny_model("llama")
    want = _mix(_runner(model, enforce_eager=True))
    runner = _runner(model, enforce_eager=True)
    stack = runner.model.model
    forward = runner.model.forward
    up = ctypes.c_ubyte(1)
    ended = []

    def ending(*args):  # type: ignore[no-untyped-def]
        stack.between_layers = abort_check(ctypes.addressof(up))
        with pytest.raises(StepAborted):
            forward(*args)
        ended.append(1)
        stack.between_layers = None
        return forward(*args)

    runner.model.forward = ending  # type: ignore[method-assign]
    got = _mix(runner)
    assert len(ended) > 5
    assert got[0] == want[0]
    for rid, logprobs in want[1].items():
        np.testing.assert_array_equal(got[1][rid], logprobs)

    # Through the runner: with the flag up, a prefill step is answered as skipped.
    runner = _runner(model, enforce_eager=True)
    runner.abort_flag = ctypes.addressof(up)
    sched = ToyScheduler(runner, budget=48)
    sched.add("p", list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=2), 2)
    out = sched.step()
    assert out.skipped and out.req_ids == ["p"]
