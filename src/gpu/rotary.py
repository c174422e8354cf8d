"""Rotary position embeddings (RoPE) for the supported families.

Reads the rope settings from the raw HF config (transformers 5.x `rope_parameters`, or the older
top-level `rope_theta` / `rope_scaling`), precomputes a cos/sin table for every position up to
`max_position_embeddings`, and applies the rotate-half form to queries and keys by position.
Supported rope types: "default" and "llama3"; any other fails at load with a clear error. Used
by the attention block of `ringserve.gpu.models.llama`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The rope settings as one dict with at least `rope_type` and `rope_theta`.

    Raises:
        ValueError: the rope type is not supported.
    """
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    params["rope_type"] = rope_type
    return params


def inverse_frequencies(params: dict[str, Any], rotary_dim: int) -> torch.Tensor:
    """The float32 inverse frequencies (transformers' formulas, same operation order)."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float) / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if params["rope_type"] == "llama3":
        inv_freq = _llama3_scaling(inv_freq, params)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """A cos/sin table by position, applied to [T, heads, head_dim] queries and keys.

    Args:
        head_dim: the rotated dimension (the whole head).
        max_position: table length (max_position_embeddings).
        params: the output of `rope_parameters`.
    """

    cos_sin: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(params, head_dim)
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_sin", torch.stack((emb.cos(), emb.sin())), persistent=False)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `q` [T, Hq, D] and `k` [T, Hk, D] by their token `positions` [T]."""
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate `x` [T, H, D] by its token `positions` [T] (queries and keys stacked on H
        rotate in one pass: the same arithmetic, half the calls)."""
        # Every layer rotates by the same step's positions: gather the table once per step.
        cached = self._last
        if cached is not None and cached[0] is positions and cached[1].dtype == x.dtype:
            table = cached[1]
        else:
            table = self.cos_sin[:, positions].to(x.dtype).unsqueeze(2)
            self._last = (positions, table)
        cos, sin = table[0], table[1]
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
