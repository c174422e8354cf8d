"""Weights repacked for oneDNN after loading (CPU, float32): same products as `F.linear`, the
plain copy dropped, other dtypes left alone; and a loaded model runs on packed weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ringserve.gpu.linear import ColumnParallelLinear, RowParallelLinear, pack_weight
from ringserve.gpu.parallel import TPGroup
from ringserve.gpu.vocab_embedding import ParallelLMHead

needs_onednn = pytest.mark.skipif(not torch._C._has_mkldnn, reason="torch built without oneDNN")


def _column(bias: bool, dtype: torch.dtype = torch.float32) -> tuple[ColumnParallelLinear, torch.Tensor]:
    layer = ColumnParallelLinear(32, [48, 16, 16], bias=bias, tp=TPGroup(), dtype=dtype)
    full = torch.randn(80, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    for shard, rows in enumerate(full.split([48, 16, 16])):
        layer.load("weight", rows, shard)
        if bias:
            layer.load("bias", torch.arange(rows.shape[0], dtype=dtype), shard)
    return layer, full


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 3, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_column_linear_matches_f_linear(rows: int, bias: bool) -> None:
    layer, full = _column(bias)
    x = torch.randn(rows, 32)
    want = layer.forward(x)
    layer.process_weights_after_loading()
    assert layer.packed is not None and layer.weight.numel() == 0
    torch.testing.assert_close(layer.forward(x), want, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():  # the model runner's mode
        torch.testing.assert_close(layer.forward(x), want, atol=1e-5, rtol=1e-5)
    if bias:
        torch.testing.assert_close(want, F.linear(x, full, layer.bias))


@needs_onednn
def test_packed_row_linear_matches_f_linear() -> None:
    layer = RowParallelLinear(64, 24, bias=True, tp=TPGroup(), dtype=torch.float32)
    weight = torch.randn(24, 64)
    layer.load("weight", weight)
    layer.load("bias", torch.ones(24))
    x = torch.randn(5, 128)[:, ::2]  # a strided input (the layout attention hands over)
    layer.process_weights_after_loading()
    assert layer.packed is not None
    torch.testing.assert_close(layer.forward(x), F.linear(x, weight) + 1, atol=1e-5, rtol=1e-5)


@needs_onednn
@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_packs_and_keeps_a_shared_weight(tied: bool) -> None:
    head = ParallelLMHead(100, 32, tp=TPGroup(), dtype=torch.float32)
    weight = torch.randn(100, 32)
    head.load("weight", weight)
    hidden = torch.randn(7, 32)
    head.process_weights_after_loading(keep_weight=tied)
    assert head.packed is not None
    assert head.weight.numel() == (weight.numel() if tied else 0)
    torch.testing.assert_close(head.compute_logits(hidden), hidden @ weight.T, atol=1e-5, rtol=1e-5)


def test_other_dtypes_keep_f_linear() -> None:
    layer, _ = _column(bias=False, dtype=torch.bfloat16)
    layer.process_weights_after_loading()
    assert layer.packed is None and layer.weight.shape == (80, 32)
    assert pack_weight(torch.zeros(4, 4, dtype=torch.float64)) is None


@needs_onednn
def test_loaded_model_runs_on_packed_weights(tiny_llama_dir: Path) -> None:
    from gpu_helpers import make_runner

    runner = make_runner(tiny_llama_dir)
    layer = runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.packed is not None  # type: ignore[union-attr]
    assert layer.mlp.down_proj.packed is not None  # type: ignore[union-attr]
    assert runner.model.lm_head.packed is not None
