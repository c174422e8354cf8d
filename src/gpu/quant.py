"""Weight-only int8 / int4 quantization of the linear layers (`--quantization int8|int4`).

The tensor-parallel linears (`ringserve.gpu.linear`) call `quantize` on their own shard of the
weight in `process_weights_after_loading` (so each rank quantizes what it holds), keep the
`QuantizedWeight` it returns and drop the float copy; `quantized_linear` is their forward.
The embedding and the LM head stay float. Activations stay in the model's dtype: only the
weights are stored quantized, and the kernels read them packed, never a dequantized copy.

- int8: symmetric round-to-nearest per output channel, scale = max |w| / 127 over the row.
  float32 activations run the project's C kernel (`ringserve.gpu.quant_native`), others (or
  a machine without a C compiler) torch's `aten._weight_int8pack_mm(x, codes [N, K], scales)`.
- int4: asymmetric round-to-nearest in groups of `INT4_GROUP_SIZE` input features:
  scale = (max - min) / 15, codes 0..15 = round((w - min) / scale), so w ~= code * scale + min.
  torch's CPU kernel computes (code - 8) * scale + zero, hence zero = min + 8 * scale; it reads
  the codes after `aten._convert_weight_to_int4pack_for_cpu` ([N, K / 2] uint8, its own
  order) and the scales and zeros as one [K / group, N, 2] tensor.

`dequantize` turns the codes back into a float weight: `F.linear(x, dequantize(codes))` is the
reference the kernels are tested against. On CPUs without AVX-512 torch runs both of its
kernels as plain loops, several times slower than the float32 GEMM (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from ringserve.config import QUANTIZATION_METHODS
from ringserve.gpu import quant_native

logger = logging.getLogger(__name__)

# Input features per int4 scale/zero pair (GGUF's Q4_0/Q4_1 block size).
INT4_GROUP_SIZE = 32
# torch's int4 CPU packing works on blocks of 16 output features.
_INT4_N_MULTIPLE = 16


@dataclass(frozen=True)
class QuantCodes:
    """A weight's quantized values before packing (the reference's input).

    Attributes:
        method: "int8" or "int4".
        codes: [N, K]: int8 in -127..127 (int8), or int32 in 0..15 (int4).
        scales: [N] (int8) or [N, K / group_size] (int4), in the weight's dtype.
        mins: int4 only: [N, K / group_size], each group's minimum (code 0).
        group_size: input features per scale (K for int8's per-channel scales).
    """

    method: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group_size: int


@dataclass(frozen=True)
class QuantizedWeight:
    """A packed weight, as the kernel reads it.

    Attributes:
        method: "int8" or "int4".
        packed: int8 codes [N, K] (int8), or torch's int4 CPU layout [N, K / 2] uint8.
        scales: [N] (int8), or scales and zeros [K / group_size, N, 2] (int4).
        out_features, in_features: N and K.
        group_size: input features per int4 group (K for int8).
    """

    method: str
    packed: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    group_size: int


def check_method(method: str) -> None:
    """Raises ValueError unless `method` is one ringserve runs."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: got {method!r}, allowed: "
                         f"{', '.join(QUANTIZATION_METHODS)}")


def quantize_codes(weight: torch.Tensor, method: str) -> QuantCodes:
    """Round-to-nearest codes and scales of a float `[N, K]` weight.

    Raises:
        ValueError: an unknown method, or a shape torch's int4 kernel cannot take (N not a
            multiple of 16, K not a multiple of `INT4_GROUP_SIZE`).
    """
    check_method(method)
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"quantization: expected a 2-D float weight, got {weight.dtype} "
                         f"{list(weight.shape)}")
    w = weight.detach().float()
    n, k = w.shape
    if method == "int8":
        # A zero row keeps scale 1 (its codes are all zero either way) to avoid 0 / 0.
        scale = w.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return QuantCodes("int8", codes, scale.to(weight.dtype), None, k)
    if n % _INT4_N_MULTIPLE or k % INT4_GROUP_SIZE:
        raise ValueError(
            f"quantization int4: a weight shard of {n} output x {k} input features; torch's "
            f"int4 kernel needs output features in multiples of {_INT4_N_MULTIPLE} and input "
            f"features in multiples of {INT4_GROUP_SIZE} (use int8)")
    groups = w.reshape(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    span = (high - low) / 15.0
    span = torch.where(span > 0, span, torch.ones_like(span))  # a constant group: codes 0
    q = torch.round((groups - low[..., None]) / span[..., None]).clamp(0, 15)
    codes = q.to(torch.int32).reshape(n, k)
    # Scales and minimums in the weight's dtype, as the kernel will read them; the
    # reference dequantizes from the same rounded values.
    return QuantCodes("int4", codes, span.to(weight.dtype), low.to(weight.dtype),
                      INT4_GROUP_SIZE)


def pack(q: QuantCodes) -> QuantizedWeight:
    """The kernel's layout of `q`."""
    n, k = q.codes.shape
    if q.method == "int8":
        return QuantizedWeight("int8", q.codes.contiguous(), q.scales.contiguous(), n, k, k)
    assert q.mins is not None  # int4 codes always carry their minimums
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.codes.contiguous(), 1)
    zeros = q.mins + 8 * q.scales
    scales_and_zeros = torch.stack([q.scales, zeros], dim=-1).transpose(0, 1).contiguous()
    return QuantizedWeight("int4", packed, scales_and_zeros, n, k, q.group_size)


def quantize(weight: torch.Tensor, method: str) -> QuantizedWeight:
    """`pack(quantize_codes(weight, method))`: what a linear layer keeps.

    Raises:
        ValueError: as `quantize_codes`, or a weight not on the CPU.
    """
    if weight.device.type != "cpu":
        raise ValueError(f"quantization {method}: runs on CPU only (weight on {weight.device})")
    if method == "int4":
        _warn_if_int4_is_slow()
    return pack(quantize_codes(weight, method))


@functools.cache
def _warn_if_int4_is_slow() -> None:
    capability = torch.backends.cpu.get_cpu_capability()
    if "AVX512" not in capability:
        # Measured on an AVX2 CPU: 6x (1 row) to 50x (64 rows) slower than float32.
        logger.warning("quantization int4: torch's int4 CPU kernel is not vectorized for %s; "
                       "expect matmuls several times slower than float32 (int8 is not)",
                       capability)


def dequantize(q: QuantCodes) -> torch.Tensor:
    """The float32 `[N, K]` weight the codes stand for (the kernels' test reference)."""
    codes = q.codes.float()
    if q.method == "int8":
        return codes * q.scales.float()[:, None]
    assert q.mins is not None
    n, k = codes.shape
    groups = codes.reshape(n, k // q.group_size, q.group_size)
    out = groups * q.scales.float()[..., None] + q.mins.float()[..., None]
    return out.reshape(n, k)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T + bias` for x `[..., K]`, from the packed weight (output in x's dtype).

    Activations whose dtype differs from the scales' (the model's dtype) are not expected:
    the model runs in one dtype.
    """
    rows = x.reshape(-1, weight.in_features)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    own = weight.method == "int8" and rows.dtype == torch.float32
    kernel = quant_native.load_kernel() if own else None
    if weight.method == "int8" and kernel is not None:
        out = quant_native.int8_linear(kernel, rows, weight.packed, weight.scales)
    elif weight.method == "int8":
        out = torch.ops.aten._weight_int8pack_mm(rows, weight.packed, weight.scales)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, weight.packed, weight.group_size, weight.scales)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.out_features)


def nbytes(weight: QuantizedWeight) -> int:
    """Bytes the packed weight and its scales occupy."""
    return (weight.packed.numel() * weight.packed.element_size()
            + weight.scales.numel() * weight.scales.element_size())
