"""Weight-only int8 / int4 quantization of the linear layers (`--quantization int8|int4`),
and the bf16 panels of a bf16 checkpoint on CPU (`BF16_WEIGHTS`: not a quantization, the
checkpoint's own values; they take the same seam: `quantize` packs them, `quantized_linear`
runs them).

The tensor-parallel linears (`ringserve.gpu.layers.linear`) and the LM head
(`ringserve.gpu.layers.vocab_embedding`) call `quantize` on their own shard of the weight in
`process_weights_after_loading` (so each rank quantizes what it holds), keep the `PanelWeight`
it returns (`ringserve.gpu.native.panel`: panels of 16 output channels, the layout of every
CPU matmul of the project, see `panel.h`) and drop the float copy; `quantized_linear` is their
forward. Activations stay in the model's dtype: only the weights are stored quantized, and the
kernels (`panel_quant.c`, AVX2) read them packed, never a dequantized copy.

- int8: symmetric round-to-nearest per output channel, scale = max |w| / 127 over the row;
  panels of int8 codes [P, K, 16] and float32 scales [P * 16] (w = code * scale).
  A weight loaded from GGUF Q8_0 blocks keeps them as they are, with one scale per group of
  32 inputs ("int8g" panels: scales [P, K / 32, 16]; its other rows repeat their channel's
  scale over the groups).
- int4: asymmetric round-to-nearest in groups of `INT4_GROUP_SIZE` input features:
  scale = (max - min) / 15, codes 0..15 = round((w - min) / scale), so w ~= code * scale + min;
  panels of uint8 [P, K / 2, 16] (inputs 2 j and 2 j + 1 in the low and high nibble of one
  byte) with float32 scales and mins [P, K / 32, 16].

The channels that pad the last panel to 16 have zero codes and zero scales. `dequantize` turns
the codes back into a float weight: `F.linear(x, dequantize(codes))` is the reference the
kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ringserve.checkpoint.gguf_codes import BlockCodes
from ringserve.checkpoint.precision import BF16_WEIGHTS
from ringserve.config import QUANTIZATION_METHODS
from ringserve.gpu.native import panel as panel_native
from ringserve.gpu.native.panel import PANEL, PanelWeight

# Input features per int4 scale/min pair (GGUF's Q4_1 block size; RS_INT4_GROUP of panel.h).
INT4_GROUP_SIZE = panel_native.INT4_GROUP


@dataclass(frozen=True)
class QuantCodes:
    """A weight's quantized values before packing (the reference's input).

    Attributes:
        method: "int8" or "int4".
        codes: [N, K]: int8 in -127..127 (int8), or int32 in 0..15 (int4).
        scales: [N] (int8 per channel) or [N, K / group_size] (int8 per group, int4), in
            the weight's dtype.
        mins: int4 only: [N, K / group_size], each group's minimum (code 0).
        group_size: input features per scale (K for int8's per-channel scales).
    """

    method: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group_size: int


def check_method(method: str) -> None:
    """Raises ValueError unless `method` is one ringserve runs (or `BF16_WEIGHTS`)."""
    if method not in QUANTIZATION_METHODS and method != BF16_WEIGHTS:
        raise ValueError(f"quantization: got {method!r}, allowed: "
                         f"{', '.join(QUANTIZATION_METHODS)}")


def quantize_codes(weight: torch.Tensor, method: str, *, int8_groups: bool = False
                   ) -> QuantCodes:
    """Round-to-nearest codes and scales of a float `[N, K]` weight.

    Args:
        weight: the float weight.
        method: "int8" or "int4".
        int8_groups: int8 with a scale per group of `INT4_GROUP_SIZE` inputs (max |w| / 127
            over the group) instead of one per output channel.

    Raises:
        ValueError: an unknown method, a weight that is not 2-D float, or (int4, grouped
            int8) K not a multiple of `INT4_GROUP_SIZE`.
    """
    check_method(method)
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"quantization: expected a 2-D float weight, got {weight.dtype} "
                         f"{list(weight.shape)}")
    w = weight.detach().float()
    n, k = w.shape
    if method == "int8" and int8_groups:
        if k % INT4_GROUP_SIZE:
            raise ValueError(f"quantization int8: per-group scales need input features in "
                             f"multiples of {INT4_GROUP_SIZE}, got {k}")
        groups = w.reshape(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        scale = groups.abs().amax(dim=-1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(groups / scale[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantCodes("int8", codes.reshape(n, k), scale.to(weight.dtype), None,
                          INT4_GROUP_SIZE)
    if method == "int8":
        # A zero row keeps scale 1 (its codes are all zero either way) to avoid 0 / 0.
        scale = w.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return QuantCodes("int8", codes, scale.to(weight.dtype), None, k)
    if k % INT4_GROUP_SIZE:
        raise ValueError(
            f"quantization int4: a weight shard of {n} output x {k} input features; int4 "
            f"needs input features in multiples of {INT4_GROUP_SIZE} (its group size; use "
            f"int8)")
    groups = w.reshape(n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    span = (high - low) / 15.0
    span = torch.where(span > 0, span, torch.ones_like(span))  # a constant group: codes 0
    q = torch.round((groups - low[..., None]) / span[..., None]).clamp(0, 15)
    codes = q.to(torch.int32).reshape(n, k)
    # Scales and minimums in the weight's dtype; the panels hold them as float32 (exactly
    # the same values), and the reference dequantizes from the same rounded values.
    return QuantCodes("int4", codes, span.to(weight.dtype), low.to(weight.dtype),
                      INT4_GROUP_SIZE)


def pack(q: QuantCodes) -> PanelWeight:
    """The panels of `q` (panel.h's RS_INT8 / RS_INT4 layout), without a bias."""
    n, k = q.codes.shape
    if q.method == "int8" and q.scales.dim() == 2:  # a scale per group of 32 inputs
        return PanelWeight("int8g", n, k, panel_native.to_panels(q.codes),
                           panel_native.to_panels(q.scales.float()))
    if q.method == "int8":
        scales = torch.zeros(panel_native.num_panels(n) * PANEL, dtype=torch.float32)
        scales[:n] = q.scales.float()
        return PanelWeight("int8", n, k, panel_native.to_panels(q.codes), scales)
    assert q.mins is not None  # int4 codes always carry their minimums
    codes = panel_native.to_panels(q.codes.to(torch.uint8))  # [P, K, 16]
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()  # [P, K / 2, 16]
    scales = panel_native.to_panels(q.scales.float())  # [P, K / 32, 16]
    mins = panel_native.to_panels(q.mins.float())
    return PanelWeight("int4", n, k, data, scales, mins)


def quantize(weight: torch.Tensor, method: str,
             as_is: Iterable[tuple[int, BlockCodes]] = (), *, grouped: bool = False,
             int8_groups: bool = False) -> PanelWeight:
    """`pack(quantize_codes(weight, method))`: what a linear layer keeps (add its bias with
    `PanelWeight.with_bias`, so the kernel adds it).

    Args:
        weight: the float weight [N, K].
        method: "int8" or "int4".
        as_is: (first row, codes) of rows loaded from a GGUF file's blocks of `method`
            (`ringserve.checkpoint.gguf_codes`), packed as they are instead of rounded from
            their floats (each row is rounded on its own, so the rest is unaffected; int8
            then keeps a scale per group of 32 inputs for every row).
        grouped: int8: per-group scales even without `as_is` (a weight update of such a
            layer, whose panels must keep their shape).
        int8_groups: int8: round every row not in `as_is` on a scale of its own per group of
            32 inputs (`quantize_codes`), not one per channel: a weight whose source had fine
            scales (a GGUF Q6_K) keeps close to them.

    Raises:
        ValueError: as `quantize_codes`, a weight not on the CPU, or codes that do not fit.
    """
    if weight.device.type != "cpu":
        raise ValueError(f"quantization {method}: runs on CPU only (weight on {weight.device})")
    if method == BF16_WEIGHTS:  # no codes: the weights themselves, in bf16 panels
        if list(as_is):
            raise ValueError("bf16 panels take no GGUF codes")
        return panel_native.pack_bf16(weight)
    as_is = list(as_is)
    if (as_is and weight.dim() == 2 and weight.dtype.is_floating_point
            and weight.shape[1] % INT4_GROUP_SIZE == 0):
        check_method(method)
        return pack(_with_codes(weight, method, as_is, int8_groups=int8_groups))
    q = quantize_codes(weight, method, int8_groups=int8_groups and method == "int8")
    if method == "int8" and (as_is or grouped) and q.scales.dim() == 1:
        q = _per_group(q)
    for row0, blocks in as_is:
        rows = blocks.codes.shape[0]
        if (blocks.method != method or blocks.codes.shape[1] != q.codes.shape[1]
                or row0 + rows > q.codes.shape[0]):
            raise ValueError(f"quantization {method}: {blocks.method} codes "
                             f"{list(blocks.codes.shape)} at row {row0} do not fit a weight "
                             f"of {list(q.codes.shape)}")
        q.codes[row0:row0 + rows] = blocks.codes.to(q.codes.dtype)
        q.scales[row0:row0 + rows] = blocks.scales.to(q.scales.dtype)
        if q.mins is not None and blocks.mins is not None:
            q.mins[row0:row0 + rows] = blocks.mins.to(q.mins.dtype)
    return pack(q)


def _with_codes(weight: torch.Tensor, method: str, as_is: list[tuple[int, BlockCodes]], *,
                int8_groups: bool) -> QuantCodes:
    """`quantize`'s codes of a weight some of whose rows keep GGUF codes: those rows copied
    as they are (their rows of `weight` are never read: a layer loaded from deferred tensors
    leaves them unwritten), the others rounded row range by row range (each row is rounded
    on its own, so this is what rounding the whole weight gives), int8 with a scale per group
    of 32 inputs throughout. Codes are kept in their own byte width (int8, or uint8 for
    int4), not widened to the whole weight's int32. `weight` is 2-D float with whole groups
    of 32 inputs."""
    n, k = weight.shape
    if len(as_is) == 1:  # codes for every row (one GGUF tensor): used as they are
        row0, blocks = as_is[0]
        dtype = torch.int8 if method == "int8" else torch.uint8
        if (row0 == 0 and blocks.method == method and tuple(blocks.codes.shape) == (n, k)
                and blocks.codes.dtype == dtype and blocks.scales.dtype == weight.dtype
                and (blocks.mins is None) == (method == "int8")):
            return QuantCodes(method, blocks.codes, blocks.scales, blocks.mins, INT4_GROUP_SIZE)
    keep = torch.zeros(n, dtype=torch.bool)
    for row0, blocks in as_is:
        rows = blocks.codes.shape[0]
        if (blocks.method != method or blocks.codes.shape[1] != k or row0 + rows > n):
            raise ValueError(f"quantization {method}: {blocks.method} codes "
                             f"{list(blocks.codes.shape)} at row {row0} do not fit a weight "
                             f"of {[n, k]}")
        keep[row0:row0 + rows] = True
    groups = k // INT4_GROUP_SIZE
    codes = torch.empty(n, k, dtype=torch.int8 if method == "int8" else torch.uint8)
    scales = torch.empty(n, groups, dtype=weight.dtype)
    mins = None if method == "int8" else torch.empty(n, groups, dtype=weight.dtype)
    for start, stop in _runs(~keep):
        part = quantize_codes(weight[start:stop], method,
                              int8_groups=int8_groups and method == "int8")
        if part.scales.dim() == 1:
            part = _per_group(part)
        codes[start:stop] = part.codes.to(codes.dtype)
        scales[start:stop] = part.scales
        if mins is not None and part.mins is not None:
            mins[start:stop] = part.mins
    for row0, blocks in as_is:
        rows = blocks.codes.shape[0]
        codes[row0:row0 + rows] = blocks.codes.to(codes.dtype)
        scales[row0:row0 + rows] = blocks.scales.to(scales.dtype)
        if mins is not None and blocks.mins is not None:
            mins[row0:row0 + rows] = blocks.mins.to(mins.dtype)
    return QuantCodes(method, codes, scales, mins, INT4_GROUP_SIZE)


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """The (start, stop) of every run of True in the 1-D `mask`."""
    edges = torch.diff(mask.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8),
                       append=torch.zeros(1, dtype=torch.int8))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    stops = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, stops, strict=True))


def _per_group(q: QuantCodes) -> QuantCodes:
    """Per-channel int8 codes with their scale repeated over every group of 32 inputs (the
    same weights)."""
    n, k = q.codes.shape
    if k % INT4_GROUP_SIZE:
        raise ValueError(f"quantization int8: per-group scales need input features in "
                         f"multiples of {INT4_GROUP_SIZE}, got {k}")
    scales = q.scales[:, None].expand(n, k // INT4_GROUP_SIZE).contiguous()
    return QuantCodes("int8", q.codes, scales, None, INT4_GROUP_SIZE)


def dequantize(q: QuantCodes) -> torch.Tensor:
    """The float32 `[N, K]` weight the codes stand for (the kernels' test reference)."""
    codes = q.codes.float()
    if q.method == "int8" and q.scales.dim() == 1:
        return codes * q.scales.float()[:, None]
    n, k = codes.shape
    groups = codes.reshape(n, k // q.group_size, q.group_size) * q.scales.float()[..., None]
    if q.mins is not None:
        groups = groups + q.mins.float()[..., None]
    return groups.reshape(n, k)


def unpack(weight: PanelWeight) -> QuantCodes:
    """The codes back from int8 / int4 panels (scales and mins as float32); `pack`'s inverse."""
    n, k = weight.out_features, weight.in_features
    assert weight.scales is not None

    def rows(panels: torch.Tensor) -> torch.Tensor:  # [P, j, 16] -> [n, j]
        return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n]

    if weight.format == "int8":
        return QuantCodes("int8", rows(weight.data), weight.scales[:n], None, k)
    if weight.format == "int8g":
        return QuantCodes("int8", rows(weight.data), rows(weight.scales), None,
                          INT4_GROUP_SIZE)
    if weight.format != "int4" or weight.mins is None:
        raise ValueError(f"quantization: {weight.format} panels hold no codes")
    data = weight.data
    codes = torch.stack([data & 15, data >> 4], dim=2).reshape(data.shape[0], k, PANEL)
    return QuantCodes("int4", rows(codes).to(torch.int32), rows(weight.scales),
                      rows(weight.mins), INT4_GROUP_SIZE)


def quantized_linear(x: torch.Tensor, weight: PanelWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T + b` for x `[..., K]` from int8 / int4 panels, in x's dtype.

    `b` is the panels' own bias (`with_bias`, added inside the kernel), plus `bias` when given.
    The kernels take float32 activations: others are converted there and back. Where the C
    library cannot be built (`panel_native.load_library` is None) the panels are dequantized
    on the fly and multiplied by torch: correct, but it rebuilds the float weight at every
    call (3072 x 576 at 1 row, 1 thread: 7-10 ms against 0.3 ms for float32 `F.linear`).
    """
    rows = x if x.dtype == torch.float32 else x.float()
    library = panel_native.load_library()
    if library is not None:
        out = panel_native.linear(library, rows, weight)
    elif weight.format == "bf16":
        out = F.linear(rows, panel_native.unpack_float(weight), weight.bias)
    else:
        out = F.linear(rows, dequantize(unpack(weight)), weight.bias)
    if bias is not None:
        out = out + bias
    return out if out.dtype == x.dtype else out.to(x.dtype)


def nbytes(weight: PanelWeight) -> int:
    """Bytes the packed weight, its scales and mins occupy (what a matmul reads)."""
    return weight.nbytes()
