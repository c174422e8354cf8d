"""GGUF's 8- and 4-bit blocks (Q8_0; Q4_0, Q4_1, Q4_K) as the codes, scales and minimums of
ringserve's int8 / int4 panels, exactly: with `--quantization int8` / `int4`, a linear layer
loaded from such a tensor keeps the file's codes instead of rounding the dequantized floats a
second time.

Every one of these formats stores, per group of 32 inputs, integer codes q and one or two
numbers with w = q * scale (+ min):
- Q8_0 (32 per block: f16 d, 32 int8 codes): scale d (int8, no min);
- Q4_0 (f16 d, 16 bytes of nibbles): scale d, min -8 d;
- Q4_1 (f16 d and m, 16 bytes): scale d, min m;
- Q4_K (256 per super-block: f16 d and dmin, twelve bytes holding eight 6-bit scales sc and
  minimums m, 128 bytes of nibbles): for sub-block j, scale d * sc_j, min -(dmin * m_j).
Inside a 4-bit block, byte i of a run of 32 bytes holds input i in its low nibble and input
i + 32 (Q4_K) or i + 16 (Q4_0 / Q4_1) in its high one. The int4 panels (`panel.h`) hold one
float32 scale and min per 32 inputs, and the int8 panels one scale per 32 inputs when they
come from Q8_0 ("int8g"), so the codes move over unchanged and every weight dequantizes to
exactly gguf-py's value (`q * scale` is exact in float32, at most 21 significant bits).

`gguf_weights.read_tensor` attaches the tensor's GGUF type and, for these four, a decoder to
the float32 tensor it yields (`attach`; decoding runs only when a layer asks); a quantized
linear layer of the same method takes the codes (`attached`) for the rows or columns it holds.
Any other tensor type is quantized from its floats as before.

Under `quantization="gguf"` (a quantized GGUF file's default, vLLM's name for serving one
from its blocks) each layer picks its own method from the types of the tensors it holds:
`panel_method` per tensor, `layer_method` for a fused layer (q/k/v, gate/up), the most precise
of its parts (float > int8 > int4), so no part loses precision to another's format.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ringserve.checkpoint.support import GGUF_QUANTIZATION

GROUP = 32  # inputs per scale (and min)
# GGUF type -> the quantization method whose panels hold its codes as they are.
METHODS = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4"}
# Types that hold floats: served as floats (float32 panels) under "gguf".
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# The quantization mode that serves each layer of a GGUF file on the panels of its own
# codes (`layer_method`); vLLM's `--quantization gguf`.
GGUF_MODE = GGUF_QUANTIZATION
_SIZES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}
_ATTR = "_ringserve_gguf_source"  # the FileTensor a float tensor read from a GGUF carries
_PRECISION = {None: 2, "int8": 1, "int4": 0}  # float > int8 > int4


def panel_method(qtype: str | None) -> str | None:
    """The panels a tensor of GGUF type `qtype` is served on under "gguf": its codes' method
    for Q8_0 / Q4_0 / Q4_1 / Q4_K, None (float) for a float type (or None: not from a GGUF
    file), and int8, rounded from the floats, for every other quantized type (Q5_*, Q6_K,
    Q2_K, Q3_K, ...: none has panels of its own, and 8 bits hold any of them closely)."""
    if qtype is None or qtype in FLOAT_TYPES:
        return None
    return METHODS.get(qtype, "int8")


def layer_method(qtypes: Iterable[str | None]) -> str | None:
    """The method of a layer whose weight is made of tensors of these GGUF types (a fused
    q/k/v or gate/up holds several): the most precise of their `panel_method`s, so a Q6_K
    part next to Q4_K ones puts the layer on int8 panels and a float part keeps it float."""
    methods = [panel_method(q) for q in qtypes]
    if not methods:
        return None
    return max(methods, key=lambda m: _PRECISION[m])


@dataclass(frozen=True)
class BlockCodes:
    """A weight's codes as the file holds them.

    Attributes:
        method: "int8" or "int4".
        codes: [N, K]: int8 (int8), or uint8 in 0..15 (int4).
        scales: float32 [N, K / 32].
        mins: int4: float32 [N, K / 32] (w = code * scale + min); int8: None (w = code * scale).
    """

    method: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def _with(self, pick: Callable[[torch.Tensor, bool], torch.Tensor]) -> BlockCodes:
        return BlockCodes(self.method, pick(self.codes, False), pick(self.scales, True),
                          None if self.mins is None else pick(self.mins, True))

    def _slice(self, pick: Callable[[torch.Tensor, bool], torch.Tensor]) -> BlockCodes:
        # Copies, so that a shard does not keep the whole tensor's codes alive until its
        # layer is quantized.
        return self._with(lambda t, grouped: pick(t, grouped).clone(
            memory_format=torch.contiguous_format))

    def rows(self, start: int, size: int) -> BlockCodes:
        """Output rows start .. start + size - 1 (a column-parallel shard; all of them: these
        codes, not a copy)."""
        if start == 0 and size == self.codes.shape[0]:
            return self
        return self._slice(lambda t, _: t[start:start + size])

    def columns(self, start: int, size: int) -> BlockCodes | None:
        """Inputs start .. start + size - 1 (a row-parallel shard), or None unless both are
        whole groups of 32."""
        if start % GROUP or size % GROUP:
            return None
        if start == 0 and size == self.codes.shape[1]:
            return self
        g0, gn = start // GROUP, size // GROUP
        return self._slice(lambda t, grouped: t[:, g0:g0 + gn] if grouped
                           else t[:, start:start + size])

    def map_rows(self, reorder: Callable[[torch.Tensor], torch.Tensor]) -> BlockCodes:
        """The same codes with their rows reordered by `reorder` (llama.cpp's q / k order
        undone), applied to codes, scales and mins alike."""
        return self._with(lambda t, _: reorder(t))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the codes stand for."""
        n, k = self.codes.shape
        groups = self.codes.reshape(n, k // GROUP, GROUP).float() * self.scales[..., None]
        if self.mins is not None:
            groups = groups + self.mins[..., None]
        return groups.reshape(n, k)


def decode(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> BlockCodes:
    """The codes, scales (and mins) of a [N, K] tensor's raw `qtype` blocks (row-major).

    Raises:
        ValueError: `qtype` is not one of METHODS, or the bytes do not fit `shape`.
    """
    n, k = shape
    if qtype not in _SIZES:
        raise ValueError(f"gguf codes: {qtype} blocks are kept as floats; kept as they are: "
                         f"{', '.join(METHODS)}")
    block, size = _SIZES[qtype]
    if k % block or raw.size != n * k // block * size:
        raise ValueError(f"gguf codes: {raw.size} bytes of {qtype} for a [{n}, {k}] tensor")
    blocks = raw.reshape(-1, size)

    def half(col: int) -> np.ndarray:  # an f16 field of every block, as float32 [blocks, 1]
        return blocks[:, col:col + 2].copy().view(np.float16).astype(np.float32)

    def tensor(a: np.ndarray, dtype: type) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype).reshape(n, -1))

    if qtype == "Q8_0":
        codes = blocks[:, 2:].copy().view(np.int8)
        return BlockCodes("int8", tensor(codes, np.int8), tensor(half(0), np.float32), None)
    if qtype == "Q4_K":
        sc, m = _k_scales(blocks[:, 4:16])
        scales, mins = half(0) * sc, -(half(2) * m)  # [blocks, 8]
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # low nibbles: sub-block 2c, high: 2c + 1
    else:
        scales = half(0)
        mins = half(2) if qtype == "Q4_1" else -8.0 * scales
        qs = blocks[:, 4 if qtype == "Q4_1" else 2:].reshape(-1, 1, 1, 16)
    nibbles = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
    return BlockCodes("int4", tensor(nibbles, np.uint8), tensor(scales, np.float32),
                      tensor(mins, np.float32))


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's eight 6-bit scales and minimums per super-block from its 12 bytes: sub-blocks
    0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes
    8-11 with their top 2 bits in the high bits of bytes 0-3 (scales) and 4-7 (mins)."""
    p = packed.astype(np.uint8)
    low_sc, low_m = p[:, 0:4] & 63, p[:, 4:8] & 63
    high_sc = (p[:, 8:12] & 15) | ((p[:, 0:4] >> 6) << 4)
    high_m = (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)
    sc = np.concatenate([low_sc, high_sc], axis=1).astype(np.float32)
    m = np.concatenate([low_m, high_m], axis=1).astype(np.float32)
    return sc, m


@dataclass(frozen=True)
class FileTensor:
    """Where a float tensor read from a GGUF file came from.

    Attributes:
        qtype: its GGUF type name ("Q4_1", "Q6_K", "F16", ...).
        decoder: the codes' decoder for the four types that keep them (METHODS), else None.
        dequantized: for a deferred tensor (`is_deferred`: its floats were not made when it
            was read), what makes them: the float32 tensor, exactly as it would have been
            read. None: the tensor carrying this source holds its floats.
    """

    qtype: str
    decoder: Callable[[], BlockCodes] | None = None
    dequantized: Callable[[], torch.Tensor] | None = None

    @property
    def method(self) -> str | None:
        """The method whose panels take these codes as they are (None: no codes)."""
        return None if self.decoder is None else METHODS[self.qtype]

    def codes(self) -> BlockCodes | None:
        """The decoded codes (None: a type without codes)."""
        return None if self.decoder is None else self.decoder()


def attach(weight: torch.Tensor, source: FileTensor) -> torch.Tensor:
    """Mark `weight` (the dequantized float tensor) as read from a GGUF tensor of
    `source.qtype`, with the decoder of its codes if it has them; returns it."""
    setattr(weight, _ATTR, source)
    return weight


def source_of(weight: torch.Tensor) -> FileTensor | None:
    """What GGUF tensor `weight` was read from (None: not from a GGUF file)."""
    source: FileTensor | None = getattr(weight, _ATTR, None)
    return source


def method_of(weight: torch.Tensor) -> str | None:
    """The method of the codes attached to `weight` (without decoding them), or None."""
    source = source_of(weight)
    return None if source is None else source.method


def attached(weight: torch.Tensor) -> BlockCodes | None:
    """The codes `weight` was dequantized from, or None (another type, or no GGUF file)."""
    source = source_of(weight)
    return None if source is None else source.codes()


def is_deferred(weight: torch.Tensor) -> bool:
    """Whether `weight` stands for a GGUF tensor whose floats were not made: a tensor on the
    meta device (any copy out of it fails) that carries its codes and the means to make the
    floats (`floats`). The loader reads a quantized model's code-holding tensors so, so a
    layer that keeps the codes never holds a float copy of them."""
    source = source_of(weight)
    return weight.is_meta and source is not None and source.dequantized is not None


def floats(weight: torch.Tensor) -> torch.Tensor:
    """`weight`'s float32 values: itself, or for a deferred tensor the floats made now (the
    whole tensor, exactly as a float read gives them; without the source attached)."""
    source = source_of(weight)
    if not weight.is_meta or source is None or source.dequantized is None:
        return weight
    return source.dequantized()
