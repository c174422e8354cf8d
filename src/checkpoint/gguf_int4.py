"""GGUF's 4-bit blocks (Q4_0, Q4_1, Q4_K) as int4 codes with a scale and a minimum per group
of 32 inputs, exactly: with `--quantization int4`, a linear layer loaded from such a tensor
keeps the file's codes instead of rounding the dequantized floats a second time.

All three store 4-bit codes q with w = q * scale + min per group of 32 inputs:
- Q4_0 (32 per block: f16 d, 16 bytes of nibbles): scale d, min -8 d;
- Q4_1 (f16 d and m, 16 bytes): scale d, min m;
- Q4_K (256 per super-block: f16 d and dmin, twelve bytes holding eight 6-bit scales sc and
  minimums m, 128 bytes of nibbles): for sub-block j, scale d * sc_j, min -(dmin * m_j).
Inside a block, byte i of a run of 32 bytes holds input i in its low nibble and input i + 32
(Q4_K) or i + 16 (Q4_0 / Q4_1) in its high one. ringserve's int4 panels (`panel.h`) hold one
float32 scale and min per 32 inputs, so the codes move over unchanged and every weight
dequantizes to exactly gguf-py's value (`q * scale` is exact in float32, at most 21
significant bits, so both round once, at the addition of the minimum).

`gguf_weights.read_tensor` attaches a decoder to the float32 tensor it yields (`attach`;
decoding runs only when a layer asks); an int4 linear layer takes it (`attached`) for the rows
or columns it holds. Any other tensor type is quantized from its floats as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # inputs per scale and min (the int4 panels' group)
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_ATTR = "_ringserve_int4_blocks"  # the decoder a float tensor carries


@dataclass(frozen=True)
class Int4Blocks:
    """A weight's 4-bit codes as the file holds them.

    Attributes:
        codes: uint8 [N, K], 0..15.
        scales, mins: float32 [N, K / 32]; w = code * scale + min.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def rows(self, start: int, size: int) -> Int4Blocks:
        """Output rows start .. start + size - 1 (a column-parallel shard)."""
        return Int4Blocks(self.codes[start:start + size], self.scales[start:start + size],
                          self.mins[start:start + size])

    def columns(self, start: int, size: int) -> Int4Blocks | None:
        """Inputs start .. start + size - 1 (a row-parallel shard), or None unless both are
        whole groups of 32."""
        if start % GROUP or size % GROUP:
            return None
        g0, gn = start // GROUP, size // GROUP
        return Int4Blocks(self.codes[:, start:start + size], self.scales[:, g0:g0 + gn],
                          self.mins[:, g0:g0 + gn])

    def map_rows(self, reorder: Callable[[torch.Tensor], torch.Tensor]) -> Int4Blocks:
        """The same blocks with their rows reordered by `reorder` (llama.cpp's q / k order
        undone), applied to codes, scales and mins alike."""
        return Int4Blocks(reorder(self.codes), reorder(self.scales), reorder(self.mins))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the codes stand for."""
        n, k = self.codes.shape
        groups = self.codes.reshape(n, k // GROUP, GROUP).float()
        return (groups * self.scales[..., None] + self.mins[..., None]).reshape(n, k)


def decode(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> Int4Blocks:
    """The codes, scales and mins of a [N, K] tensor's raw `qtype` blocks (row-major).

    Raises:
        ValueError: `qtype` is not one of INT4_TYPES, or the bytes do not fit `shape`.
    """
    n, k = shape
    sizes = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}
    if qtype not in sizes:
        raise ValueError(f"gguf int4: {qtype} blocks hold no int4 codes; allowed: "
                         f"{', '.join(INT4_TYPES)}")
    block, size = sizes[qtype]
    if k % block or raw.size != n * k // block * size:
        raise ValueError(f"gguf int4: {raw.size} bytes of {qtype} for a [{n}, {k}] tensor")
    blocks = raw.reshape(-1, size)

    def half(col: int) -> np.ndarray:  # an f16 field of every block, as float32 [blocks, 1]
        return blocks[:, col:col + 2].copy().view(np.float16).astype(np.float32)

    if qtype == "Q4_K":
        d, dmin = half(0), half(2)
        sc, m = _k_scales(blocks[:, 4:16])
        scales, mins = d * sc, -(dmin * m)  # [blocks, 8]
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # low nibbles: sub-block 2c, high: 2c + 1
    else:
        d = half(0)
        scales = d
        mins = half(2) if qtype == "Q4_1" else -8.0 * d
        qs = blocks[:, 4 if qtype == "Q4_1" else 2:].reshape(-1, 1, 1, 16)
    codes = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
    return Int4Blocks(torch.from_numpy(np.ascontiguousarray(codes).reshape(n, k)),
                      torch.from_numpy(np.ascontiguousarray(scales, np.float32).reshape(n, -1)),
                      torch.from_numpy(np.ascontiguousarray(mins, np.float32).reshape(n, -1)))


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


def attach(weight: torch.Tensor, decoder: Callable[[], Int4Blocks]) -> torch.Tensor:
    """Give `weight` (the dequantized float tensor) the decoder of its codes; returns it."""
    setattr(weight, _ATTR, decoder)
    return weight


def carries(weight: torch.Tensor) -> bool:
    """Whether `weight` has int4 codes attached (without decoding them)."""
    return getattr(weight, _ATTR, None) is not None


def attached(weight: torch.Tensor) -> Int4Blocks | None:
    """The codes `weight` was dequantized from, or None (another type, or no GGUF file)."""
    decoder: Callable[[], Int4Blocks] | None = getattr(weight, _ATTR, None)
    return None if decoder is None else decoder()
