"""The int8 / int4 / int8g (int8 with a scale per 32 inputs) panel kernels (src/gpu/native/panel_quant.c) against the torch reference
`F.linear(x, dequantize(codes))`: every tile size (rows 1..13 and 64), output features that
leave the last panel partly empty, input features from 1 (int8) or 32 (int4) to 1536, with and
without the panels' bias, on one thread and split over two (the same result); and the C
contract: y is overwritten, the channels past n are never written, and the panels are laid
out as panel.h says."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from ringserve.gpu.layers.quant import QuantCodes, dequantize, pack, quantize_codes, unpack
from ringserve.gpu.native import panel as panel_native

ROWS = [*range(1, 14), 64]
SHAPES = [("int8", k) for k in (1, 7, 32, 33, 100, 577, 1536)] + [
    (method, k) for method in ("int4", "int8g") for k in (32, 64, 96, 576, 1536)]
METHODS = ["int8", "int4", "int8g"]
# Float32 rounding (the kernels sum in another order than torch, and int4 sums per group)
# relative to the sum of |x_j w_j|: measured below 5e-6 for these shapes.
RTOL = 3e-5


@pytest.fixture(scope="module")
def library() -> ctypes.CDLL:
    lib = panel_native.load_library()
    assert lib is not None  # the test machines have a C compiler
    return lib


@pytest.fixture
def one_thread() -> Iterator[None]:
    """panel_native.linear runs on torch's thread count: one here, so that the sweeps stay
    fast on a loaded machine (each parallel region waits for its slowest thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _codes(weight: torch.Tensor, method: str) -> QuantCodes:
    """Round-to-nearest codes; "int8g": int8 codes with a random scale per group of 32 inputs
    (as GGUF's Q8_0 blocks), packed as RS_INT8G panels."""
    if method != "int8g":
        return quantize_codes(weight, method)
    n, k = weight.shape
    codes = quantize_codes(weight, "int8").codes
    scales = torch.rand(n, k // 32, generator=torch.Generator().manual_seed(n + k)) + 0.01
    return QuantCodes("int8", codes, scales, None, 32)


class _Reference:
    """`F.linear(x, w, bias)` in float64 and the sum of |terms| it is compared against (one
    product for every row count: a row's result does not depend on the others)."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
        b = None if bias is None else bias.double()
        self.want = F.linear(x.double(), w.double(), b)
        self.scale = F.linear(x.double().abs(), w.double().abs(),
                              None if b is None else b.abs()).clamp_min(1e-30)

    def check(self, got: torch.Tensor) -> None:
        rows = got.shape[0]
        error = (got.double() - self.want[:rows]).abs() / self.scale[:rows]
        assert float(error.max()) <= RTOL, f"max error {float(error.max()):.2e} of sum |x w| " \
            f"(rows {rows})"


@pytest.mark.parametrize(("method", "k"), SHAPES)
@pytest.mark.usefixtures("one_thread")
def test_kernel_equals_dequantize_then_matmul(library: ctypes.CDLL, method: str, k: int) -> None:
    for n in (40, 100):  # 2.5 and 6.25 panels
        codes = _codes(_randn(n, k, seed=n + k), method)
        weight = dequantize(codes)
        bias = _randn(n, seed=3)
        x_all = _randn(max(ROWS), k, seed=4)
        for b in (None, bias):
            panels = pack(codes).with_bias(b)
            reference = _Reference(x_all, weight, b)
            for rows in ROWS:
                reference.check(panel_native.linear(library, x_all[:rows], panels))


@pytest.mark.parametrize("method", METHODS)
def test_a_thread_split_computes_the_same(library: ctypes.CDLL, method: str) -> None:
    n, k = 100, 96  # 7 panels: 4 and 3 per thread
    codes = _codes(_randn(n, k, seed=9), method)
    panels = pack(codes).with_bias(_randn(n, seed=10))
    x_all = _randn(max(ROWS), k, seed=11)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append([panel_native.linear(library, x_all[:rows], panels) for rows in ROWS])
    finally:
        torch.set_num_threads(before)
    reference = _Reference(x_all, dequantize(codes), panels.bias)
    for one, two in zip(*results, strict=True):
        reference.check(two)
        assert torch.equal(one, two)  # each panel is computed alike on any thread


@pytest.mark.parametrize("method", METHODS)
def test_y_is_overwritten_and_channels_past_n_are_not_written(library: ctypes.CDLL,
                                                              method: str) -> None:
    n, k = 40, 64
    codes = _codes(_randn(n, k, seed=5), method)
    panels = pack(codes)
    for rows in (1, 5, 7):
        x = _randn(rows, k, seed=rows)
        y = torch.full((rows * n + 2 * panel_native.PANEL,), float("nan"))
        library.rs_linear(ctypes.byref(panels.struct), x.data_ptr(), rows, y.data_ptr(), 1)
        _Reference(x, dequantize(codes), None).check(y[: rows * n].view(rows, n))
        assert bool(y[rows * n:].isnan().all()), "a channel past n was written"


@pytest.mark.parametrize("method", METHODS)
def test_a_panel_range_with_row_strides(library: ctypes.CDLL, method: str) -> None:
    """`rs_panels` as the fused decode step calls it: panels p0..p1 only, x and y rows
    strided (ldx > k, ldy > n), and more rows than rs_linear hands a kernel at once (48)."""
    n, k, ldx, ldy = 100, 64, 64 + 3, 100 + 5
    codes = _codes(_randn(n, k, seed=12), method)
    panels = pack(codes).with_bias(_randn(n, seed=13))
    assert panels.bias is not None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.rs_panels.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, i64]
    library.rs_panels.restype = None
    p0, p1 = 2, 7  # channels 32..99: the last panel partly padding
    c0 = p0 * panel_native.PANEL
    for rows in (7, 100):
        x = _randn(rows, ldx, seed=14)
        y = torch.full((rows, ldy), float("nan"))
        library.rs_panels(ctypes.byref(panels.struct), x.data_ptr(), rows, ldx, y.data_ptr(),
                          ldy, p0, p1)
        _Reference(x[:, :k], dequantize(codes)[c0:], panels.bias[c0:]).check(y[:, c0:n])
        assert bool(y[:, :c0].isnan().all()) and bool(y[:, n:].isnan().all())


def test_int8_panels_follow_panel_h() -> None:
    codes = quantize_codes(_randn(20, 3, seed=6), "int8")
    panels = pack(codes)
    assert panels.format == "int8" and panels.data.dtype == torch.int8
    assert panels.data.shape == (2, 3, 16) and panels.scales is not None
    assert panels.scales.shape == (32,) and panels.mins is None
    # data[p, j, l] = code of channel 16 p + l, input j; padded channels zero (code, scale).
    assert int(panels.data[1, 2, 3]) == int(codes.codes[19, 2])
    assert bool((panels.data[1, :, 4:] == 0).all()) and bool((panels.scales[20:] == 0).all())
    assert torch.equal(panels.scales[:20], codes.scales)


def test_int8g_panels_follow_panel_h() -> None:
    codes = _codes(_randn(20, 64, seed=6), "int8g")
    panels = pack(codes)
    assert panels.format == "int8g" and panels.data.dtype == torch.int8
    assert panels.data.shape == (2, 64, 16) and panels.scales is not None
    assert panels.scales.shape == (2, 2, 16) and panels.mins is None
    assert int(panels.data[1, 40, 3]) == int(codes.codes[19, 40])
    assert float(panels.scales[1, 1, 3]) == float(codes.scales[19, 1])


def test_int4_panels_follow_panel_h() -> None:
    codes = quantize_codes(_randn(20, 64, seed=7), "int4")
    panels = pack(codes)
    assert panels.format == "int4" and panels.data.dtype == torch.uint8
    assert panels.data.shape == (2, 32, 16)
    assert panels.scales is not None and panels.mins is not None
    assert panels.scales.shape == panels.mins.shape == (2, 2, 16)
    # Byte (p, j, l): input 2 j of channel 16 p + l in the low nibble, 2 j + 1 in the high.
    byte = int(panels.data[1, 5, 3])
    assert byte & 15 == int(codes.codes[19, 10]) and byte >> 4 == int(codes.codes[19, 11])
    assert float(panels.scales[1, 1, 3]) == float(codes.scales[19, 1])
    assert codes.mins is not None and float(panels.mins[1, 1, 3]) == float(codes.mins[19, 1])
    assert bool((panels.data[1, :, 4:] == 0).all()) and bool((panels.scales[1, :, 4:] == 0).all())


@pytest.mark.parametrize("method", METHODS)
def test_unpack_inverts_pack(method: str) -> None:
    codes = _codes(_randn(50, 96, seed=8), method)
    back = unpack(pack(codes))
    assert torch.equal(back.codes, codes.codes.to(back.codes.dtype))
    assert torch.equal(dequantize(back), dequantize(codes))
