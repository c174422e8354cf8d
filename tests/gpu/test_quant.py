"""Weight-only int8 / int4 quantization (ringserve.gpu.layers.quant): `quantized_linear` on the
panels equals a dequantize-then-matmul reference (the C kernels, and the torch fallback used
without a C compiler), the rounding error is bounded by half a step, the linear layers quantize
their shard after loading, the settings are checked, and the tiny Llama quantized keeps close
to the float model (greedy tokens and logprobs). The kernels' own sweep over shapes is
test_panel_quant.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import make_runner
from runner_driver import ToyScheduler

from ringserve.config import ModelConfig
from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.layers.linear import ColumnParallelLinear, RowParallelLinear
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.layers.quant import (
    INT4_GROUP_SIZE,
    dequantize,
    pack,
    quantize,
    quantize_codes,
    quantized_linear,
)
from ringserve.gpu.native import panel as panel_native
from ringserve.sampling_params import SamplingParams


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_kernel_equals_dequantize_then_matmul(method: str, rows: int) -> None:
    w = _weight(96, 128)
    codes = quantize_codes(w, method)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(96)
    want = F.linear(x, dequantize(codes), bias)
    # The bias folded into the panels (added by the kernel) or passed along.
    torch.testing.assert_close(quantized_linear(x, pack(codes).with_bias(bias)), want,
                               atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(quantized_linear(x, pack(codes), bias), want, atol=2e-4,
                               rtol=1e-4)
    # Leading dimensions are kept: [2, rows, K] -> [2, rows, N].
    got3 = quantized_linear(torch.stack([x, x]), pack(codes))
    assert got3.shape == (2, rows, 96)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_c_kernels_and_torch_fallback_agree(monkeypatch: pytest.MonkeyPatch,
                                            method: str) -> None:
    assert panel_native.load_library() is not None  # the test machines have a C compiler
    w = _weight(50, 96)  # 50 outputs: the last panel is partly padding
    codes = quantize_codes(w, method)
    panels = pack(codes).with_bias(torch.randn(50))
    for rows in (0, 1, 5, 33):
        x = torch.randn(rows, 96)
        ours = quantized_linear(x, panels)
        torch.testing.assert_close(ours, F.linear(x, dequantize(codes), panels.bias),
                                   atol=2e-4, rtol=1e-4)
        with monkeypatch.context() as patch:
            patch.setattr(panel_native, "load_library", lambda: None)
            torch.testing.assert_close(quantized_linear(x, panels), ours, atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="panel linear"):
        quantized_linear(torch.randn(2, 97), panels)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_bfloat16_activations(method: str) -> None:
    w = _weight(64, 64).bfloat16()
    codes = quantize_codes(w, method)
    x = torch.randn(5, 64).bfloat16()
    got = quantized_linear(x, pack(codes))
    assert got.dtype == torch.bfloat16
    want = F.linear(x.float(), dequantize(codes))
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.02)


def test_rounding_error_is_at_most_half_a_step() -> None:
    w = _weight(32, 64)
    w[3] = 0.0  # a zero row and a constant group must not divide by zero
    w[4, :INT4_GROUP_SIZE] = 0.5
    int8 = quantize_codes(w, "int8")
    step8 = int8.scales[:, None]
    assert bool(((dequantize(int8) - w).abs() <= step8 / 2 + 1e-6).all())
    assert int8.codes.dtype == torch.int8 and int(int8.codes.abs().max()) <= 127
    int4 = quantize_codes(w, "int4")
    step4 = int4.scales.repeat_interleave(INT4_GROUP_SIZE, dim=1)
    assert bool(((dequantize(int4) - w).abs() <= step4 / 2 + 1e-6).all())
    assert int(int4.codes.min()) >= 0 and int(int4.codes.max()) <= 15
    assert torch.equal(dequantize(int8)[3], torch.zeros(64))


def test_int4_refuses_shapes_its_kernel_cannot_take() -> None:
    # Any number of outputs (the panels pad to 16); inputs in whole groups of 32.
    assert quantize(_weight(40, 64), "int4").data.shape == (3, 32, 16)
    with pytest.raises(ValueError, match=f"multiples of {INT4_GROUP_SIZE}"):
        quantize(_weight(48, 40), "int4")
    with pytest.raises(ValueError, match="allowed: int8, int4"):
        quantize(_weight(48, 64), "fp8")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_linear_layers_quantize_their_shard_after_loading(method: str) -> None:
    tp = TPGroup()
    col = ColumnParallelLinear(64, [64, 32], bias=True, tp=tp, dtype=torch.float32,
                               quantization=method)
    full = _weight(96, 64)
    col.load("weight", full[:64], 0)
    col.load("weight", full[64:], 1)
    col.load("bias", torch.arange(64.0), 0)
    col.load("bias", torch.zeros(32), 1)
    row = RowParallelLinear(96, 48, bias=False, tp=tp, dtype=torch.float32, quantization=method)
    down = _weight(48, 96, seed=2)
    row.load("weight", down)
    x = torch.randn(3, 64)
    float_out = row.forward(col.forward(x))
    col.process_weights_after_loading()
    row.process_weights_after_loading()
    assert col.panel is not None and col.panel.format == method
    assert col.weight.numel() == 0 and col.packed is None
    assert row.panel is not None and row.panel.format == method and row.weight.numel() == 0
    hidden = col.forward(x)
    torch.testing.assert_close(
        hidden, F.linear(x, dequantize(quantize_codes(full, method)), col.bias), atol=2e-4,
        rtol=1e-4)
    out = row.forward(hidden)
    assert (out - float_out).abs().max() < 0.1 * float_out.abs().max()


@pytest.mark.slow
def test_settings_are_checked(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"EngineArgs\.quantization: got 'awq'"):
        EngineArgs(model=str(tiny_llama_dir), quantization="awq").verify()
    with pytest.raises(ValueError, match=r"quantization: got 'gptq', allowed: None"):
        ModelConfig.from_model_dir(str(tiny_llama_dir), quantization="gptq")
    with pytest.raises(ValueError, match="runs on CPU only"):
        ModelConfig.from_model_dir(str(tiny_llama_dir), quantization="int8", device="cuda")
    with pytest.raises(ValueError, match="allowed: int8, int4"):
        ColumnParallelLinear(8, [8], bias=False, tp=TPGroup(), dtype=torch.float32,
                             quantization="nf4")
    config = ModelConfig.from_model_dir(str(tiny_llama_dir), quantization="int4")
    assert config.quantization == "int4"


_PROMPTS = [[5 + 97 * i + j * 13 % 800 for j in range(6 + i)] for i in range(4)]
_NEW_TOKENS = 12


def _greedy(runner_dir: Path, quantization: str | None) -> tuple[dict[str, list[int]], object]:
    runner = make_runner(runner_dir, quantization=quantization)
    sched = ToyScheduler(runner)
    for i, prompt in enumerate(_PROMPTS):
        sched.add(f"r{i}", prompt, SamplingParams(temperature=0.0), _NEW_TOKENS)
    return sched.run(), runner


def _teacher_forced(runner: object, sequences: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(top-1 token, logprob of the given token) at every position after the first."""
    sched = ToyScheduler(runner)  # type: ignore[arg-type]
    for i, seq in enumerate(sequences):
        sched.add(f"t{i}", seq, SamplingParams(temperature=0.0, prompt_logprobs=1), 1)
    sched.run()
    top, given = [], []
    for i in range(len(sequences)):
        chunks = sched.done[f"t{i}"].prompt_logprobs
        ids = np.concatenate([c.token_ids for c in chunks])
        values = np.concatenate([c.logprobs for c in chunks])
        top.append(ids[:, 1])
        given.append(values[:, 0])
    return np.concatenate(top), np.concatenate(given)


@pytest.mark.slow
def test_tiny_llama_quantized_stays_close_to_float(tiny_llama_dir: Path) -> None:
    float_out, float_runner = _greedy(tiny_llama_dir, None)
    sequences = [_PROMPTS[i] + float_out[f"r{i}"] for i in range(len(_PROMPTS))]
    # Positions whose next token the float model chose greedily (the generated part).
    generated = np.concatenate([np.arange(len(s) - 1) >= len(p) - 1
                                for s, p in zip(sequences, _PROMPTS, strict=True)])
    float_top, float_lp = _teacher_forced(float_runner, sequences)
    results = {}
    for method in ("int8", "int4"):
        out, runner = _greedy(tiny_llama_dir, method)
        free = np.mean([a == b for i in range(len(_PROMPTS))
                        for a, b in zip(out[f"r{i}"], float_out[f"r{i}"], strict=True)])
        top, lp = _teacher_forced(runner, sequences)
        agree = float(np.mean(top[generated] == float_top[generated]))
        diff = float(np.mean(np.abs(lp - float_lp)))
        results[method] = (float(free), agree, diff)
    print("free-running greedy agreement, teacher-forced top-1 agreement, mean |dlogprob|:",
          results)
    # Measured (deterministic weights and prompts, 48 generated positions; the LM head
    # quantized too): int8 0.92 top-1 agreement, 0.011 mean |dlogprob|; int4 0.63 and 0.14
    # (before, with a float LM head and torch's kernels: 0.67 and 0.13). The tiny random
    # model has many near-ties, so real checkpoints agree more; the bounds leave margin for
    # torch versions.
    assert results["int8"][1] >= 0.85 and results["int8"][2] < 0.03, results
    assert results["int4"][1] >= 0.5 and results["int4"][2] < 0.3, results
