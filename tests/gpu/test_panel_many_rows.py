"""Many-row float32 matmuls (`panel.linear` at `MANY_ROWS` rows and more) go to torch's GEMM on
the weight read out of the panels: results within float32 rounding of the panel kernel's and of
`F.linear` on the plain weight, for partial panels, with and without a folded bias, leading
batch dimensions and strided inputs; fewer rows and quantized panels stay in the C kernel."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ringserve.gpu.layers.quant import quantize
from ringserve.gpu.native import panel as panel_native

LIBRARY = panel_native.load_library()
pytestmark = pytest.mark.skipif(LIBRARY is None, reason="no C compiler with OpenMP")
FEW = 8  # MANY_ROWS in these tests, to keep them small


class CountingLibrary:
    """The real library, counting `rs_linear` calls (which rows went to the C kernel)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._library = library
        self.calls = 0

    def rs_linear(self, *args: Any) -> int:
        self.calls += 1
        status: int = self._library.rs_linear(*args)
        return status


@pytest.fixture(autouse=True)
def few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(panel_native, "MANY_ROWS", FEW)


def _tolerance(x: torch.Tensor, weight: torch.Tensor) -> dict[str, float]:
    # float32 rounding of a k-term dot product, relative to the sum of |terms|.
    scale = float((x.abs() @ weight.abs().t()).max())
    return {"atol": 4 * x.shape[-1] ** 0.5 * 2**-24 * scale, "rtol": 0.0}


@pytest.mark.parametrize(("n", "k"), [(37, 24), (48, 576), (100, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_many_rows_match_the_panel_kernel_and_f_linear(
    monkeypatch: pytest.MonkeyPatch, n: int, k: int, bias: bool,
) -> None:
    assert LIBRARY is not None
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    panels = panel_native.pack_f32(weight, b)
    counting = CountingLibrary(LIBRARY)
    for rows in (FEW - 1, FEW, FEW + 29):
        x = torch.randn(rows, k, generator=gen)
        got = panel_native.linear(counting, x, panels)  # type: ignore[arg-type]
        with monkeypatch.context() as kernel_only:
            kernel_only.setattr(panel_native, "MANY_ROWS", 1 << 62)
            kernel = panel_native.linear(LIBRARY, x, panels)
        tol = _tolerance(x, weight)
        torch.testing.assert_close(got, kernel, **tol)
        torch.testing.assert_close(got, F.linear(x, weight, b), **tol)
    assert counting.calls == 1  # only the FEW - 1 rows went to the C kernel


def test_many_rows_keep_leading_dimensions_and_take_strided_input() -> None:
    assert LIBRARY is not None
    weight, bias = torch.randn(20, 32), torch.randn(20)
    panels = panel_native.pack_f32(weight, bias)
    x = torch.randn(2, 9, 64)[:, :, ::2]  # [2, 9, 32], strided: 18 rows
    got = panel_native.linear(LIBRARY, x, panels)
    assert got.shape == (2, 9, 20)
    torch.testing.assert_close(got, F.linear(x, weight, bias), **_tolerance(x, weight))


def test_quantized_panels_stay_in_the_c_kernel() -> None:
    assert LIBRARY is not None
    weight = torch.randn(32, 64)
    counting = CountingLibrary(LIBRARY)
    x = torch.randn(2 * FEW, 64)
    panel_native.linear(counting, x, quantize(weight, "int8"))  # type: ignore[arg-type]
    assert counting.calls == 1
