"""Rotary position embeddings (RoPE): the rope settings of a HF config, the cos/sin table by
position, and the rotate-half rotation of queries and keys.

Owns reading the rope settings from a raw HF config dict (`rope_parameters`), the inverse
frequencies and attention factor of each rope type (`rope_frequencies`, the same formulas and
operation order as transformers' `ROPE_INIT_FUNCTIONS`, so float32 tables match), and
`RotaryEmbedding`, the table the attention block of `ringserve.gpu.models.llama` (and any
family built on it) rotates by. Model code that needs a separate table per layer type (Gemma 3's
local layers) calls `rope_parameters(hf_config, "sliding_attention")` and builds a second
`RotaryEmbedding`.

Config formats read: transformers 5's `rope_parameters` (which may hold `rope_theta` and
`partial_rotary_factor` itself, or be keyed by layer type as in Gemma 3), and the older
`rope_scaling` dict (type under "rope_type" or "type") with top-level `rope_theta`; an old Gemma 3
config's `rope_local_base_freq` is the sliding layers' base, its `rope_scaling` the full layers'
only. A top-level `original_max_position_embeddings` (Phi-3) wins over the rope dict's, as in
transformers. "su" means "longrope", and so does "yarn" on a Phi-3 config (transformers' Phi3Config
renames both).

Supported rope types: default, linear, dynamic, llama3, yarn, longrope. Partial rotary
(`partial_rotary_factor` < 1) rotates only the first `rotary_dim` channels of each head and
passes the rest through (transformers' Phi-3 / GPT-NeoX form). yarn and longrope scale cos and
sin by their attention factor, folded into the table.

Where ringserve equals transformers, and where it cannot. transformers makes two types depend on
the sequence being run rather than on the position alone: `dynamic` recomputes the NTK base from
`seq_len = max(position_ids) + 1` once a forward pass goes past `max_position_embeddings`, and
`longrope` switches every position of a pass to `long_factor` once `seq_len` passes
`original_max_position_embeddings`. A paged engine cannot do that: a key is rotated once, stored
in the KV cache, shared by prefix-cache hits and computed in prefill chunks, and one batch holds
many sequences, so the table here is a fixed function of the position (which also keeps a
preempted request's recomputed keys equal to the ones it had). It is chosen so that it
reproduces transformers' cached greedy generation step by step:

- default, linear, llama3, yarn: position-independent frequencies; equal at every position.
- longrope: positions below `original_max_position_embeddings` use `short_factor`, positions at
  or above it `long_factor`. A generation whose prompt fits in the original context equals
  transformers at every step, also after it grows past the original context: transformers keeps
  the short-factor keys it cached and rotates each new token (one per step, `seq_len` = its
  position + 1) with the long factors, exactly as this table does. A prompt longer than the
  original context differs: transformers rotates the whole prompt, its first positions too, with
  the long factors; here they keep the short ones. (vLLM instead uses the long factors at every
  position whenever max_model_len exceeds the original context, which differs from transformers
  for short prompts too.)
- dynamic: positions below `max_position_embeddings` use the unscaled frequencies (transformers'
  init values); a position p at or above it uses the base transformers computes for
  `seq_len = p + 1`. ringserve's max_model_len for a dynamic config is `max_position_embeddings`
  times the factor (as vLLM's), so the table reaches past that threshold. As for longrope, a
  generation whose prompt fits in `max_position_embeddings` equals transformers at every step,
  also past it; a longer prompt differs (transformers rotates all of it, from position 0, with
  the base for its whole length). (vLLM uses one base, scaled for `max_position_embeddings *
  factor`, at every position, which differs from transformers at every length.)

Equal means bit for bit in float32 (tests/gpu/test_rope_variants.py checks the frequencies, the
table, and the table against transformers' cached one-token steps past the threshold).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# rope-dict keys each type needs (beyond rope_type and rope_theta)
_REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}
# types whose frequencies are computed against the pretraining context length
_USES_ORIGINAL_CONTEXT = ("llama3", "yarn", "longrope")
_LAYER_TYPE_KEYS = ("full_attention", "sliding_attention")
_GEMMA3_MODEL_TYPES = ("gemma3", "gemma3_text")
_GEMMA3_GLOBAL_THETA, _GEMMA3_LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' defaults
_DEFAULT_THETA = 10_000.0


def rope_parameters(hf_config: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings for the layers of `layer_type`, as one flat dict.

    Args:
        hf_config: the raw config.json dict (for a multimodal Gemma 3, its `text_config`).
        layer_type: a `layer_types` entry ("full_attention", "sliding_attention"); None means
            the model's single rope (for a config keyed by layer type: its full-attention one).

    Returns:
        The rope dict with at least `rope_type` (one of SUPPORTED_ROPE_TYPES), `rope_theta`,
        `partial_rotary_factor` and `max_position_embeddings`, plus
        `original_max_position_embeddings` for llama3, yarn and longrope, and the type's own keys.

    Raises:
        ValueError: the rope type is not supported, a key it needs is missing, or
            `layer_type` has no entry in a config keyed by layer type.
    """
    entry, theta_default = _rope_entry(hf_config, layer_type)
    rope_type = str(entry.get("rope_type") or entry.get("type") or "default")
    if rope_type == "mrope" and entry.get("mrope_section"):
        rope_type = "default"  # Qwen2-VL's legacy name: default frequencies, sectioned positions
    if rope_type == "su" or (rope_type == "yarn" and hf_config.get("model_type") == "phi3"):
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    missing = [key for key in _REQUIRED_KEYS.get(rope_type, ()) if entry.get(key) is None]
    if missing:
        raise ValueError(
            f"rope type {rope_type!r} needs {', '.join(missing)} in rope_parameters/rope_scaling; "
            f"got keys: {', '.join(sorted(entry)) or 'none'}"
        )
    params = {key: value for key, value in entry.items() if key != "type"}
    params["rope_type"] = rope_type
    theta = entry.get("rope_theta")
    params["rope_theta"] = float(theta if theta is not None else theta_default)
    partial = entry.get("partial_rotary_factor", hf_config.get("partial_rotary_factor"))
    params["partial_rotary_factor"] = float(partial if partial is not None else 1.0)
    max_positions = int(hf_config.get("max_position_embeddings") or 0)
    params["max_position_embeddings"] = max_positions
    if rope_type in _USES_ORIGINAL_CONTEXT:
        original = hf_config.get("original_max_position_embeddings")
        if original is None:
            original = entry.get("original_max_position_embeddings") or max_positions
        params["original_max_position_embeddings"] = int(original)
    if params.get("original_max_position_embeddings") == 0 or (
        rope_type == "dynamic" and max_positions < 1
    ):
        raise ValueError(
            f"rope type {rope_type!r} needs max_position_embeddings (>= 1) in config.json; "
            f"got {hf_config.get('max_position_embeddings')!r}"
        )
    return params


def _rope_entry(hf_config: dict[str, Any], layer_type: str | None) -> tuple[dict[str, Any], float]:
    """The raw rope dict that applies to `layer_type`, and the base to use when it has none."""
    scaling = hf_config.get("rope_scaling")
    params = hf_config.get("rope_parameters")
    gemma3 = hf_config.get("model_type") in _GEMMA3_MODEL_TYPES or "rope_local_base_freq" in hf_config
    theta = hf_config.get("rope_theta")
    global_theta = float(theta) if theta is not None else (
        _GEMMA3_GLOBAL_THETA if gemma3 else _DEFAULT_THETA
    )
    labels = {*_LAYER_TYPE_KEYS, *(hf_config.get("layer_types") or ())}
    if isinstance(params, dict) and any(key in labels for key in params):
        key = layer_type or "full_attention"
        if key not in params:
            raise ValueError(
                f"rope_parameters has no entry for layer type {key!r}; has: {', '.join(params)}"
            )
        if params[key] is None:
            raise ValueError(f"rope_parameters[{key!r}] is null (a layer without rope): not supported")
        entry = dict(params[key])
        if scaling and key == "full_attention":  # Gemma 3 applies a legacy rope_scaling there
            entry.update(scaling)
        local = key == "sliding_attention"
        return entry, _local_theta(hf_config) if local and gemma3 else global_theta
    if gemma3 and layer_type == "sliding_attention":
        # old Gemma 3 configs: local layers use plain rope on their own base, never the scaling
        return {"rope_type": "default", "rope_theta": _local_theta(hf_config)}, _GEMMA3_LOCAL_THETA
    # transformers 5 reads rope_scaling first when a config has both
    return dict(scaling or params or {}), global_theta


def _local_theta(hf_config: dict[str, Any]) -> float:
    local = hf_config.get("rope_local_base_freq")
    return float(local) if local is not None else _GEMMA3_LOCAL_THETA


def rotary_dim(params: dict[str, Any], head_dim: int) -> int:
    """How many channels of each head the frequencies are computed over (transformers' `dim`)."""
    return int(head_dim * float(params.get("partial_rotary_factor", 1.0)))


def rope_frequencies(
    params: dict[str, Any], head_dim: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """The float32 inverse frequencies and the attention factor for one sequence length.

    Mirrors `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config,
    seq_len=seq_len)`: the same formulas in the same order. `seq_len` matters only for dynamic
    (the NTK base for that length, never below `max_position_embeddings`) and longrope
    (`long_factor` beyond `original_max_position_embeddings`); None means the init values.

    Args:
        params: the output of `rope_parameters`.
        head_dim: the attention head size (before `partial_rotary_factor`).
        seq_len: the sequence length the frequencies are for.

    Raises:
        ValueError: longrope factor lists of the wrong length.
    """
    rope_type = params["rope_type"]
    dim = rotary_dim(params, head_dim)
    if rope_type == "yarn":
        return _yarn(params, dim)
    if rope_type == "longrope":
        return _longrope(params, dim, seq_len)
    if rope_type == "dynamic":
        length = max(seq_len or 0, int(params["max_position_embeddings"]))
        return _dynamic_inv_freq(params, dim, length), 1.0
    inv_freq = _default_inv_freq(float(params["rope_theta"]), dim)
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, params)
    return inv_freq, 1.0


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** _exponents(dim))


def _dynamic_inv_freq(params: dict[str, Any], dim: int, seq_len: int) -> torch.Tensor:
    # Python-float arithmetic, as transformers does at init (seq_len an int there).
    factor, max_positions = float(params["factor"]), int(params["max_position_embeddings"])
    base = float(params["rope_theta"])
    base = base * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    return _default_inv_freq(base, dim)


def _dynamic_inv_freq_by_length(
    params: dict[str, Any], dim: int, seq_lens: torch.Tensor
) -> torch.Tensor:
    """[N, dim/2] frequencies, row i for sequence length `seq_lens[i]` (int64).

    float32 tensor arithmetic, as transformers' forward-time update does (its seq_len is a
    0-dim tensor there), except the one pow: torch's vectorized float32 pow rounds differently
    from its 0-dim one, which computes in double and rounds once; `math.pow` does the same.
    """
    factor, max_positions = float(params["factor"]), int(params["max_position_embeddings"])
    ratio = (factor * torch.clamp(seq_lens, min=max_positions) / max_positions) - (factor - 1)
    exponent = dim / (dim - 2)
    stretch = torch.tensor([math.pow(r, exponent) for r in ratio.tolist()], dtype=torch.float32)
    base = float(params["rope_theta"]) * stretch
    return 1.0 / (base[:, None] ** _exponents(dim)[None, :])


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:  # DeepSeek-style configs: the context ratio is the factor
        factor = params["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # the channel whose wavelength makes `rotations` turns over the original context
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # keep the ramp finite
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies kept), 0: interpolate (divided by factor)
    pos_freqs = base ** _exponents(dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)


def _longrope(
    params: dict[str, Any], dim: int, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:  # Phi-3 configs: the context ratio is the factor
        factor = params["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = bool(seq_len and seq_len > original)
    key = "long_factor" if long else "short_factor"
    ext = torch.tensor(params[key], dtype=torch.float32)
    shape = _exponents(dim)
    if ext.shape != shape.shape:
        raise ValueError(
            f"rope {key} must have {shape.numel()} entries (rotary dim {dim} / 2); got {ext.numel()}"
        )
    return 1.0 / (ext * float(params["rope_theta"]) ** shape), float(attention)


def cos_sin_table(params: dict[str, Any], head_dim: int, max_position: int) -> torch.Tensor:
    """The float32 [2, max_position, rotary width] cos/sin table, attention factor included.

    Row p is what transformers' rotary embedding returns for position p in cached one-token
    steps (see the module docstring for dynamic and longrope).
    """
    inv_freq, attention = rope_frequencies(params, head_dim)
    positions = torch.arange(max_position, dtype=torch.float)
    freqs = positions[:, None] * inv_freq[None, :]
    rope_type = params["rope_type"]
    if rope_type == "longrope":
        start = int(params["original_max_position_embeddings"])
        if max_position > start:
            long_inv_freq, _ = rope_frequencies(params, head_dim, seq_len=start + 1)
            freqs[start:] = positions[start:, None] * long_inv_freq[None, :]
    elif rope_type == "dynamic":
        start = int(params["max_position_embeddings"])
        if max_position > start:
            lengths = torch.arange(start, max_position, dtype=torch.int64) + 1
            by_length = _dynamic_inv_freq_by_length(params, rotary_dim(params, head_dim), lengths)
            freqs[start:] = positions[start:, None] * by_length
    emb = torch.cat((freqs, freqs), dim=-1)
    table = torch.stack((emb.cos(), emb.sin()))
    return table * attention if attention != 1.0 else table


class RotaryEmbedding(nn.Module):
    """A cos/sin table by position, applied to [T, heads, head_dim] queries and keys.

    Args:
        head_dim: the attention head size; the first `rotary_dim` channels rotate
            (all of them unless `partial_rotary_factor` < 1), the rest pass through.
        max_position: table length (max_position_embeddings).
        params: the output of `rope_parameters`.

    Raises:
        ValueError: the rotary dimension is empty or larger than the head.
    """

    cos_sin: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        table = cos_sin_table(params, head_dim, max_position)
        self.rotary_dim = int(table.shape[-1])
        if not 0 < self.rotary_dim <= head_dim:
            raise ValueError(
                f"rotary dimension {self.rotary_dim} (partial_rotary_factor "
                f"{params.get('partial_rotary_factor', 1.0)}) must be in 1..head_dim {head_dim}"
            )
        self.register_buffer("cos_sin", table, persistent=False)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        # M-RoPE (Qwen2-VL): frequency sections rotated by the temporal, height and width
        # position streams in turn; positions then come as [3, T] for image tokens.
        section = params.get("mrope_section")
        self.mrope_section: list[int] | None = [int(x) for x in section] if section else None

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
        elif positions.dim() == 2:
            table = self._mrope_table(positions).to(x.dtype).unsqueeze(2)
            self._last = (positions, table)
        else:
            table = self.cos_sin[:, positions].to(x.dtype).unsqueeze(2)
            self._last = (positions, table)
        cos, sin = table[0], table[1]
        if self.rotary_dim == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


    def _mrope_table(self, positions: torch.Tensor) -> torch.Tensor:
        """cos/sin [2, T, D] for M-RoPE positions [3, T]: each section of frequencies (in
        both halves of the head, as transformers splits the duplicated table) takes its
        stream's position."""
        if self.mrope_section is None:
            raise ValueError("positions [3, T] need an M-RoPE model (mrope_section)")
        tables = self.cos_sin[:, positions]  # [2, 3, T, D]
        parts = torch.split(tables, self.mrope_section * 2, dim=-1)
        return torch.cat([part[:, i % 3] for i, part in enumerate(parts)], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
