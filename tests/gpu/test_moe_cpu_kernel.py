"""The MoE SwiGLU experts' C kernel (src/gpu/native/moe_cpu.c through
`ringserve.gpu.moe.cpu_experts.PackedExperts`) against the torch reference
`grouped._looped_swiglu`: float32 panels for shapes whose H and I leave the last panel partly
empty, experts without rows, more rows than one task's block (48), P = 1 and P = 0; int8 / int4
panels against the reference on the dequantized weights; one and two threads alike; `refresh`
writing new weights in place; its SiLU over a wide range; and the input checks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ringserve.gpu.layers.quant import dequantize, quantize_codes
from ringserve.gpu.moe.cpu_experts import PackedExperts, available
from ringserve.gpu.moe.grouped import _looped_swiglu

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler with OpenMP")

# (E, H, I, counts): H and I off the panel width (16), an expert without rows, one expert
# with more rows than a task's block of 48, P = 1 and P = 0.
FLOAT_CASES = [
    (4, 64, 32, [3, 0, 5, 1]),
    (3, 40, 24, [2, 7, 0]),
    (5, 33, 17, [0, 1, 0, 0, 2]),
    (2, 48, 80, [50, 61]),
    (3, 24, 40, [0, 1, 0]),
    (3, 24, 40, [0, 0, 0]),
]


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _weights(e: int, h: int, i: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] and w2 [E, H, I] scaled as trained layers are (outputs of order 1)."""
    return _randn(e, 2 * i, h, seed=seed) / h**0.5, _randn(e, h, i, seed=seed + 1) / i**0.5


def _check(got: torch.Tensor, want: torch.Tensor, tolerance: float = 1e-5) -> None:
    """Float32 rounding (the kernel sums in another order) relative to the outputs' size."""
    assert got.shape == want.shape and got.dtype == torch.float32
    if want.numel():
        scale = float(want.abs().max())
        error = float((got - want).abs().max())
        assert error <= tolerance * max(scale, 1.0), f"max error {error:.2e} at scale {scale:.2f}"


def _dequantized(stacked: torch.Tensor, method: str) -> torch.Tensor:
    return torch.stack([dequantize(quantize_codes(w, method)) for w in stacked])


@pytest.mark.parametrize(("e", "h", "i", "counts"), FLOAT_CASES)
@pytest.mark.usefixtures("two_threads")
def test_float_panels_equal_the_torch_loop(e: int, h: int, i: int, counts: list[int]) -> None:
    w13, w2 = _weights(e, h, i, seed=h + i)
    experts = PackedExperts.pack(w13, w2)
    counts_t = torch.tensor(counts)
    rows = _randn(sum(counts), h, seed=7)
    _check(experts.forward(rows, counts_t), _looped_swiglu(rows, w13, w2, counts_t))


@pytest.mark.parametrize(("method", "h", "i"), [("int8", 40, 24), ("int8", 64, 32),
                                                 ("int4", 64, 32), ("int4", 96, 64)])
@pytest.mark.usefixtures("two_threads")
def test_quantized_panels_equal_the_loop_on_dequantized_weights(method: str, h: int,
                                                                 i: int) -> None:
    w13, w2 = _weights(4, h, i, seed=3)
    experts = PackedExperts.pack(w13, w2, method)
    counts = torch.tensor([2, 0, 9, 53])
    rows = _randn(int(counts.sum()), h, seed=4)
    want = _looped_swiglu(rows, _dequantized(w13, method), _dequantized(w2, method), counts)
    _check(experts.forward(rows, counts), want, tolerance=3e-5)


def test_one_and_two_threads_compute_the_same() -> None:
    w13, w2 = _weights(3, 40, 24, seed=5)
    experts = PackedExperts.pack(w13, w2)
    counts = torch.tensor([13, 0, 60])
    rows = _randn(73, 40, seed=6)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(experts.forward(rows, counts))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(*results)  # each panel of each row block is computed alike anywhere


@pytest.mark.parametrize("method", [None, "int8", "int4"])
def test_refresh_writes_new_weights_in_place(method: str | None) -> None:
    h, i = 64, 32
    experts = PackedExperts.pack(*_weights(3, h, i, seed=8), method)
    nbytes = experts.nbytes()
    w13, w2 = (w.to(torch.bfloat16) for w in _weights(3, h, i, seed=20))  # a bf16 trainer's
    experts.refresh(w13, w2)
    if method is None:
        w13, w2 = w13.float(), w2.float()
    else:  # int8 / int4 scales are rounded to the weight's dtype, as the reference's
        w13, w2 = _dequantized(w13, method), _dequantized(w2, method)
    counts = torch.tensor([4, 1, 0])
    rows = _randn(5, h, seed=9)
    _check(experts.forward(rows, counts), _looped_swiglu(rows, w13, w2, counts), 3e-5)
    assert experts.nbytes() == nbytes


@pytest.mark.parametrize("inter", [16, 21])  # the 8-lane path only, and a scalar tail
def test_silu_over_a_wide_range(inter: int) -> None:
    """Identity gate, up = 1 and identity down: the output is silu(x) itself."""
    h = inter + 1  # the last input is the constant 1 the up rows read
    w13 = torch.zeros(1, 2 * inter, h)
    w13[0, :inter, :inter] = torch.eye(inter)
    w13[0, inter:, inter] = 1
    w2 = torch.zeros(1, h, inter)
    w2[0, :inter] = torch.eye(inter)
    x = torch.cat([torch.linspace(-100, 100, 20001),
                   torch.tensor([0.0, 1e-30, -1e-30, 87.5, -87.5, 88.5, -88.5, 1e-5, -1e-5])])
    x = torch.nn.functional.pad(x, (0, -x.numel() % inter)).view(-1, inter)
    rows = torch.cat([x, torch.ones(x.shape[0], 1)], dim=1)
    got = PackedExperts.pack(w13, w2).forward(rows, torch.tensor([rows.shape[0]]))[:, :inter]
    want = torch.nn.functional.silu(x.double())
    relative = (got.double() - want).abs() / want.abs().clamp_min(1e-30)
    assert float(relative.max()) <= 1e-6


def test_bad_inputs_say_what_is_wrong() -> None:
    w13, w2 = _weights(2, 64, 32, seed=10)
    experts = PackedExperts.pack(w13, w2)
    rows, counts = _randn(3, 64, seed=11), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="rows must be float32"):
        experts.forward(rows.double(), counts)
    with pytest.raises(ValueError, match="rows must be float32"):
        experts.forward(rows[:, :40], counts)
    with pytest.raises(ValueError, match="counts must be int64"):
        experts.forward(rows, counts.int())
    with pytest.raises(ValueError, match="counts must be int64"):
        experts.forward(rows, torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="sum to the 3 rows"):
        experts.forward(rows, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="sum to the 3 rows"):
        experts.forward(rows, torch.tensor([-1, 4]))
    with pytest.raises(ValueError, match=r"expected \[E, 2I, H\]"):
        PackedExperts.pack(w13, w2[:, :, :16])
    with pytest.raises(ValueError, match="3-D float"):
        PackedExperts.pack(w13[0], w2)
    with pytest.raises(ValueError, match="allowed"):
        PackedExperts.pack(w13, w2, "fp8")
    with pytest.raises(ValueError, match="multiples of 32"):
        PackedExperts.pack(*_weights(2, 40, 24, seed=12), "int4")
    with pytest.raises(ValueError, match="packed as"):
        experts.refresh(*_weights(3, 64, 32, seed=13))
