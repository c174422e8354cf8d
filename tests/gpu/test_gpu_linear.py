"""Weights repacked after loading (CPU, float32): into the project's panels (the C matmul
library), or for oneDNN where the library cannot be built; the same products as `F.linear`
(bias folded in), the plain copy dropped, other dtypes left alone; a loaded model runs on
panels; and the panel kernel itself over row counts, widths and thread counts."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ringserve.gpu.layers.linear import ColumnParallelLinear, RowParallelLinear, pack_weight
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.layers.vocab_embedding import ParallelLMHead
from ringserve.gpu.native import panel as panel_native

needs_onednn = pytest.mark.skipif(not torch._C._has_mkldnn, reason="torch built without oneDNN")
LIBRARY = panel_native.load_library()
needs_library = pytest.mark.skipif(LIBRARY is None, reason="no C compiler with OpenMP")


@pytest.fixture(params=["panels", "onednn"])
def packing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the panel library, and again as if it could not be built."""
    if request.param == "panels" and LIBRARY is None:
        pytest.skip("no C compiler with OpenMP")
    if request.param == "onednn":
        if not torch._C._has_mkldnn:
            pytest.skip("torch built without oneDNN")
        monkeypatch.setattr(panel_native, "load_library", lambda: None)
    return str(request.param)


def _packed(layer: ColumnParallelLinear | RowParallelLinear | ParallelLMHead, packing: str) -> bool:
    return (layer.panel is not None) if packing == "panels" else (layer.packed is not None)


def _column(bias: bool, dtype: torch.dtype = torch.float32) -> tuple[ColumnParallelLinear, torch.Tensor]:
    layer = ColumnParallelLinear(32, [48, 16, 16], bias=bias, tp=TPGroup(), dtype=dtype)
    full = torch.randn(80, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    for shard, rows in enumerate(full.split([48, 16, 16])):
        layer.load("weight", rows, shard)
        if bias:
            layer.load("bias", torch.arange(rows.shape[0], dtype=dtype), shard)
    return layer, full


@pytest.mark.parametrize("rows", [0, 1, 3, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_column_linear_matches_f_linear(rows: int, bias: bool, packing: str) -> None:
    layer, full = _column(bias)
    x = torch.randn(rows, 32)
    want = layer.forward(x)
    layer.process_weights_after_loading()
    assert _packed(layer, packing) and layer.weight.numel() == 0
    torch.testing.assert_close(layer.forward(x), want, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():  # the model runner's mode
        torch.testing.assert_close(layer.forward(x), want, atol=1e-5, rtol=1e-5)
    if bias:
        torch.testing.assert_close(want, F.linear(x, full, layer.bias))


@pytest.mark.parametrize("bias", [False, True])
def test_packed_row_linear_matches_f_linear(bias: bool, packing: str) -> None:
    layer = RowParallelLinear(64, 24, bias=bias, tp=TPGroup(), dtype=torch.float32)
    weight = torch.randn(24, 64)
    layer.load("weight", weight)
    if bias:
        layer.load("bias", torch.ones(24))
    x = torch.randn(5, 128)[:, ::2]  # a strided input (the layout attention hands over)
    layer.process_weights_after_loading()
    assert _packed(layer, packing)
    want = F.linear(x, weight) + (1 if bias else 0)
    torch.testing.assert_close(layer.forward(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_packs_and_keeps_a_shared_weight(tied: bool, packing: str) -> None:
    head = ParallelLMHead(100, 32, tp=TPGroup(), dtype=torch.float32)
    weight = torch.randn(100, 32)
    head.load("weight", weight)
    hidden = torch.randn(7, 32)
    head.process_weights_after_loading(keep_weight=tied)
    assert _packed(head, packing)
    assert head.weight.numel() == (weight.numel() if tied else 0)
    torch.testing.assert_close(head.compute_logits(hidden), hidden @ weight.T, atol=1e-5, rtol=1e-5)


def test_other_dtypes_keep_f_linear() -> None:
    layer, _ = _column(bias=False, dtype=torch.bfloat16)
    layer.process_weights_after_loading()
    assert layer.packed is None and layer.panel is None and layer.weight.shape == (80, 32)
    assert pack_weight(torch.zeros(4, 4, dtype=torch.float64)) is None


def test_loaded_model_runs_on_packed_weights(tiny_llama_dir: Path, packing: str) -> None:
    from gpu_helpers import make_runner

    runner = make_runner(tiny_llama_dir)
    layer = runner.model.model.layers[0]
    assert _packed(layer.self_attn.qkv_proj, packing)  # type: ignore[union-attr,arg-type]
    assert _packed(layer.mlp.down_proj, packing)  # type: ignore[union-attr,arg-type]
    assert _packed(runner.model.lm_head, packing)


@needs_library
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(16, 8), (40, 96), (100, 576), (7, 33)])
def test_panel_kernel_matches_f_linear(n: int, k: int, threads: int) -> None:
    assert LIBRARY is not None
    gen = torch.Generator().manual_seed(n * k)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    panels = panel_native.pack_f32(weight, bias)
    assert panels.data.shape == (panel_native.num_panels(n), k, 16)
    assert torch.equal(panel_native.unpack_f32(panels), weight)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in [*range(1, 14), 64, 97]:  # every tile height, several row blocks
            x = torch.randn(rows, k, generator=gen)
            got = panel_native.linear(LIBRARY, x, panels)
            torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(old)
    with pytest.raises(ValueError, match="panel linear"):
        panel_native.linear(LIBRARY, torch.randn(2, k + 1), panels)


def _has_avx512() -> bool:
    try:
        return " avx512f " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


@pytest.fixture(scope="module")
def avx2_library() -> ctypes.CDLL:
    """The panel library built again with -mno-avx512f: the AVX2 kernels."""
    from ringserve.gpu.native import build as native_build

    cc = native_build.compiler()
    assert cc is not None and LIBRARY is not None
    avx2 = native_build.build_library(
        panel_native.SOURCES, "panel-avx2", cc, [*native_build.OPENMP_FLAGS, "-mno-avx512f"],
        ["-lm"], headers=panel_native.HEADERS)
    avx2.rs_linear.argtypes = LIBRARY.rs_linear.argtypes
    return avx2


@needs_library
@pytest.mark.skipif(not _has_avx512(), reason="no AVX-512: the native build is the AVX2 one")
@pytest.mark.parametrize("method", ["f32", "int8", "int4", "int8g", "bf16"])
def test_avx512_tiles_equal_the_avx2_build_bit_for_bit(method: str,
                                                       avx2_library: ctypes.CDLL) -> None:
    """On an AVX-512 machine the library's zmm tiles run (float32: 4-8 rows with one
    accumulator per row; int8 / int4 / int8g / bf16: 16 channels per register); built with
    -mno-avx512f, the same sources run the AVX2 tiles. Every output is the same sequence of operations in
    both, so the products are equal bit for bit, except float32 rows that the AVX2 split
    puts in its 1-row tile (which pairs its inputs); those agree to rounding. This keeps the
    AVX2 path (the CPU the project targets) tested on AVX-512 machines."""
    from ringserve.gpu.layers import quant

    assert LIBRARY is not None
    gen = torch.Generator().manual_seed(5)
    for n, k in [(40, 96), (100, 576), (7, 64)]:
        weight = torch.randn(n, k, generator=gen)
        if method == "f32":
            panels = panel_native.pack_f32(weight, None)
        elif method == "bf16":  # one zmm of 16 channels per row against two ymm
            panels = panel_native.pack_bf16(weight, None)
        elif method == "int8g":  # int8 codes with a scale per 32 inputs (Q8_0 as it is)
            codes = quant.quantize_codes(weight, "int8").codes
            scales = torch.rand(n, k // 32, generator=gen) + 0.01
            panels = quant.pack(quant.QuantCodes("int8", codes, scales, None, 32))
        else:
            panels = quant.quantize(weight, method)
        for rows in [*range(1, 20), 32, 48, 64, 97]:
            x = torch.randn(rows, k, generator=gen)
            got = [torch.empty(rows, n), torch.empty(rows, n)]
            for lib, out in zip((LIBRARY, avx2_library), got, strict=True):
                lib.rs_linear(ctypes.byref(panels.struct), x.data_ptr(), rows, out.data_ptr(), 2)
            blocks = [min(48, rows - i) for i in range(0, rows, 48)]
            if method != "f32" or all(b == 1 or b % 6 != 1 for b in blocks):
                assert torch.equal(got[0], got[1]), (method, n, k, rows)
            else:
                torch.testing.assert_close(got[0], got[1], atol=1e-4, rtol=1e-5)
