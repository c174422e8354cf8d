"""The Qwen2-VL and Qwen2.5-VL vision towers with their patch mergers: one `VisionEncoder`.

Owns the vision side of both families: the patch embedding, the 2-D rotary vision blocks and
the merger that folds each `merge_size x merge_size` square of patches into one language-model
token. Qwen2-VL blocks use LayerNorm, a QuickGELU MLP and full attention per frame; Qwen2.5-VL
blocks use RMSNorm, a gated SiLU MLP and attention inside windows of `window_size` pixels,
except the blocks listed in `fullatt_block_indexes`, which attend over the whole frame.

The multimodal runner seam builds it with `Qwen2VLVisionEncoder.from_hf_config`, hands it the
checkpoint's `visual.*` tensors and calls `encode` once per image with the arrays of
transformers' `Qwen2VLImageProcessorPil`. Submodule names are transformers', so checkpoint
names load as they are; transformers' modeling_qwen2_vl / modeling_qwen2_5_vl is the oracle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_PREFIX = "visual."
_EPS = 1e-6  # every norm of both towers


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "gelu": F.gelu,
}


@dataclass(frozen=True, slots=True)
class Qwen2VLVisionSpec:
    """The shape of a Qwen2-VL / Qwen2.5-VL vision tower, read from the checkpoint's config.

    Attributes:
        windowed: Qwen2.5-VL (RMSNorm, gated MLP, window attention); else Qwen2-VL.
        width: the tower's hidden size (`embed_dim` in Qwen2-VL, `hidden_size` in 2.5).
        out_size: the merger's output size, the language model's hidden size.
        window_units: a window's side in merged tokens (Qwen2.5-VL only).
        full_attention_blocks: the blocks that attend over the whole frame (every block in
            Qwen2-VL).
    """

    windowed: bool
    depth: int
    width: int
    num_heads: int
    mlp_hidden: int
    hidden_act: str
    out_size: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    rope_theta: float
    window_units: int
    full_attention_blocks: frozenset[int]

    @property
    def head_dim(self) -> int:
        """The width of one attention head."""
        return self.width // self.num_heads

    @property
    def patch_features(self) -> int:
        """The length of one row of `pixel_values`."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def __post_init__(self) -> None:
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not supported; "
                             f"supported: {sorted(_ACTIVATIONS)}")
        if self.width % self.num_heads or self.head_dim % 4:
            # The 2-D rotary gives each head two halves (rows, columns) of sin/cos pairs.
            raise ValueError(f"vision width {self.width} over {self.num_heads} heads must give "
                             f"a head size divisible by 4")
        if self.windowed and self.window_units < 1:
            raise ValueError(f"window_size must cover at least one merged token "
                             f"({self.merge_size * self.patch_size} pixels)")

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> Qwen2VLVisionSpec:
        """The spec of a checkpoint's config.json (a Qwen2VLConfig / Qwen2_5_VLConfig dict).
        Keys a config leaves out take transformers' defaults.

        Raises:
            ValueError: not a Qwen2-VL / Qwen2.5-VL config, or one this tower cannot run.
        """
        model_type, v = hf_config.get("model_type"), hf_config.get("vision_config")
        if model_type not in ("qwen2_vl", "qwen2_5_vl") or not isinstance(v, Mapping):
            raise ValueError(f"expected a qwen2_vl or qwen2_5_vl config with a vision_config, "
                             f"got model_type={model_type!r}")
        windowed = model_type == "qwen2_5_vl"
        if windowed:
            width = int(v.get("hidden_size", 3584))
            mlp_hidden = int(v.get("intermediate_size", 3420))
            out_size = int(v.get("out_hidden_size", 3584))
        else:
            # Qwen2-VL names the tower's width `embed_dim` and the merger's output `hidden_size`.
            width = int(v.get("embed_dim", 1280))
            mlp_hidden = int(width * float(v.get("mlp_ratio", 4)))
            out_size = int(v.get("hidden_size", 3584))
        text = hf_config.get("text_config") or {}
        text_hidden = text.get("hidden_size", hf_config.get("hidden_size"))
        if text_hidden is not None and int(text_hidden) != out_size:
            raise ValueError(f"the vision merger outputs {out_size} features but the text "
                             f"model's hidden size is {text_hidden}")
        depth, patch = int(v.get("depth", 32)), int(v.get("patch_size", 14))
        merge = int(v.get("spatial_merge_size", 2))
        rope: Mapping[str, Any] = v.get("rope_parameters") or {}
        return cls(
            windowed=windowed, depth=depth, width=width, num_heads=int(v.get("num_heads", 16)),
            mlp_hidden=mlp_hidden, out_size=out_size,
            hidden_act=str(v.get("hidden_act", "silu" if windowed else "quick_gelu")),
            # Pre-transformers-5 config.json files spell it `in_chans`.
            in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
            patch_size=patch, temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            merge_size=merge,
            rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
            window_units=int(v.get("window_size", 112)) // merge // patch if windowed else 0,
            full_attention_blocks=frozenset(
                (int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31)))
                if windowed else range(depth)),
        )


class _RMSNorm(nn.Module):
    """Qwen2.5-VL's RMSNorm: normalised in float32, scaled after casting back, as
    transformers does (the order matters in bfloat16)."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised `x`."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + _EPS)
        return self.weight * x32.to(x.dtype)


def _norm(spec: Qwen2VLVisionSpec, dtype: torch.dtype) -> nn.LayerNorm | _RMSNorm:
    return _RMSNorm(spec.width, dtype) if spec.windowed else nn.LayerNorm(
        spec.width, eps=_EPS, dtype=dtype)


@dataclass(frozen=True, slots=True)
class _Segments:
    """`count` attention segments of `length` tokens each, at the rows `rows` (segment after
    segment), or, when `rows` is None, the whole sequence in order."""

    count: int
    length: int
    rows: torch.Tensor | None


def _segments(lengths: torch.Tensor) -> list[_Segments]:
    """Group segments (token runs that attend only among themselves) by length, so each group
    is one batched `scaled_dot_product_attention` call with neither padding nor mask. Windows
    come in at most four lengths per frame (whole, cut on the right, the bottom, or both)."""
    sizes = sorted(set(lengths.tolist()))
    if len(sizes) == 1:
        return [_Segments(lengths.numel(), sizes[0], None)]
    starts = lengths.cumsum(0) - lengths
    groups = []
    for length in sizes:
        first = starts[lengths == length]
        rows = first[:, None] + torch.arange(length, device=lengths.device)
        groups.append(_Segments(first.numel(), length, rows.flatten()))
    return groups


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of [N, heads, head_dim] in float32 (as transformers does)."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, spec: Qwen2VLVisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.qkv = nn.Linear(spec.width, 3 * spec.width, dtype=dtype)
        self.proj = nn.Linear(spec.width, spec.width, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[_Segments]) -> torch.Tensor:
        """[N, width] -> [N, width], each token attending only within its segment."""
        tokens = x.shape[0]
        q, k, v = self.qkv.forward(x).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        context = x.new_empty(tokens, x.shape[1])
        for seg in segments:
            if seg.rows is None:  # the lone group: the whole sequence, in order
                context = self._attend(q, k, v, seg)
            else:
                part = self._attend(q[seg.rows], k[seg.rows], v[seg.rows], seg)
                context.index_copy_(0, seg.rows, part)
        return self.proj.forward(context)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                seg: _Segments) -> torch.Tensor:
        """[count * length, heads, head_dim] each -> [count * length, width]."""
        def heads_first(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(seg.count, seg.length, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v))
        return out.transpose(1, 2).reshape(seg.count * seg.length, -1)


class _Mlp(nn.Module):
    """Qwen2-VL's `fc2(act(fc1(x)))`."""

    def __init__(self, spec: Qwen2VLVisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = _ACTIVATIONS[spec.hidden_act]
        self.fc1 = nn.Linear(spec.width, spec.mlp_hidden, dtype=dtype)
        self.fc2 = nn.Linear(spec.mlp_hidden, spec.width, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, width] -> [N, width]."""
        return self.fc2.forward(self.act(self.fc1.forward(x)))


class _GatedMlp(nn.Module):
    """Qwen2.5-VL's `down(act(gate(x)) * up(x))`, every projection with a bias."""

    def __init__(self, spec: Qwen2VLVisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = _ACTIVATIONS[spec.hidden_act]
        self.gate_proj = nn.Linear(spec.width, spec.mlp_hidden, dtype=dtype)
        self.up_proj = nn.Linear(spec.width, spec.mlp_hidden, dtype=dtype)
        self.down_proj = nn.Linear(spec.mlp_hidden, spec.width, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, width] -> [N, width]."""
        gated = self.act(self.gate_proj.forward(x)) * self.up_proj.forward(x)
        return self.down_proj.forward(gated)


class _Block(nn.Module):
    def __init__(self, spec: Qwen2VLVisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = _norm(spec, dtype)
        self.norm2 = _norm(spec, dtype)
        self.attn = _Attention(spec, dtype)
        self.mlp = _GatedMlp(spec, dtype) if spec.windowed else _Mlp(spec, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[_Segments]) -> torch.Tensor:
        """One pre-norm block: attention, then the MLP, each added to the residual."""
        x = x + self.attn.forward(self.norm1.forward(x), cos, sin, segments)
        return x + self.mlp.forward(self.norm2.forward(x))


class _PatchEmbed(nn.Module):
    def __init__(self, spec: Qwen2VLVisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        kernel = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj = nn.Conv3d(spec.in_channels, spec.width, kernel, stride=kernel, bias=False,
                              dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, patch_features] -> [N, width]. Each row is one whole (C, T, P, P) patch and the
        kernel covers exactly one, so transformers' Conv3d is this one matmul (a plain GEMM,
        where a 3-D convolution can be slow; bfloat16 results may differ in the last bit)."""
        return F.linear(pixels, self.proj.weight.view(self.proj.out_channels, -1))


class _PatchMerger(nn.Module):
    def __init__(self, spec: Qwen2VLVisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.merged = spec.width * spec.merge_size**2
        self.ln_q = _norm(spec, dtype)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged, dtype=dtype), nn.GELU(),
                                 nn.Linear(self.merged, spec.out_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, width] -> [N / merge_size**2, out_size]: a merge unit's patches are adjacent
        rows, so one view concatenates them."""
        out: torch.Tensor = self.mlp(self.ln_q.forward(x).view(-1, self.merged))
        return out


class Qwen2VLVisionEncoder(nn.Module):
    """A Qwen2-VL or Qwen2.5-VL vision tower and merger behind the `VisionEncoder` protocol.

    Parameters are named as transformers names them under `visual.`.
    """

    def __init__(self, spec: Qwen2VLVisionSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = _PatchEmbed(spec, dtype)
        self.blocks = nn.ModuleList(_Block(spec, dtype) for _ in range(spec.depth))
        self.merger = _PatchMerger(spec, dtype)

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any], dtype: torch.dtype,
                       device: torch.device) -> Qwen2VLVisionEncoder:
        """The encoder of a checkpoint's config.json, in `dtype` on `device`, its parameters
        uninitialised until `load_weights`.

        Raises:
            ValueError: see `Qwen2VLVisionSpec.from_hf_config`.
        """
        spec = Qwen2VLVisionSpec.from_hf_config(hf_config)
        with torch.device("meta"):  # no time spent initialising what the checkpoint replaces
            encoder = cls(spec, dtype)
        return encoder.to_empty(device=device).requires_grad_(False).eval()

    def owns(self, name: str) -> bool:
        """True for the vision tower's checkpoint tensors (`visual.*`)."""
        return name.startswith(_PREFIX)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy `visual.*` checkpoint tensors into the encoder, cast to its dtype.

        Raises:
            ValueError: a tensor matching no parameter or of the wrong shape (naming it), or
                a parameter no tensor filled (naming them).
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                key = name[len(_PREFIX):] if self.owns(name) else None
                param = None if key is None else params.get(key)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the "
                                     f"Qwen2-VL vision tower")
                if param.shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name!r} has shape "
                                     f"{tuple(tensor.shape)}, expected {tuple(param.shape)}")
                param.copy_(tensor)
                loaded.add(name[len(_PREFIX):])
        missing = sorted(params.keys() - loaded)
        if missing:
            shown = ", ".join(_PREFIX + m for m in missing[:5])
            raise ValueError(f"the checkpoint lacks {len(missing)} vision tensor(s): {shown}")

    def encode(self, data: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One image's (or clip's) rows for the language model.

        Args:
            data: `pixel_values` [t*h*w, C*T*P*P] and `image_grid_thw` [1, 3] as
                `Qwen2VLImageProcessorPil` returns them for one image.

        Returns:
            [t*h*w / merge_size**2, out_size] in the encoder's dtype, in the order of the
            image's placeholder tokens.

        Raises:
            ValueError: arrays missing or of shapes that disagree.
        """
        spec, weight = self.spec, self.patch_embed.proj.weight
        t, h, w = _grid(data, spec)
        unit = spec.merge_size**2
        with torch.no_grad():
            x = self.patch_embed.forward(data["pixel_values"].to(weight.device, weight.dtype))
            cos, sin = _rotary(spec, t, h, w, x.device)
            frames = _segments(torch.full((t,), h * w, device=x.device))
            windows, order = frames, None
            if spec.windowed:
                # Tokens are regrouped window by window (a merge unit's patches stay adjacent)
                # so every window is one contiguous run; the merger's rows are put back after.
                order, sizes = _window_order(spec, t, h, w, x.device)
                tokens = (order[:, None] * unit + torch.arange(unit, device=x.device)).flatten()
                x, cos, sin = x[tokens], cos[tokens], sin[tokens]
                windows = _segments(sizes * unit)
            for i, block in enumerate(self.blocks):
                x = block(x, cos, sin, frames if i in spec.full_attention_blocks else windows)
            merged = self.merger.forward(x)
            return merged if order is None else merged[torch.argsort(order)]


def _grid(data: Mapping[str, torch.Tensor], spec: Qwen2VLVisionSpec) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of one image's arrays, checked against its pixels."""
    if "pixel_values" not in data or "image_grid_thw" not in data:
        raise ValueError(f"expected pixel_values and image_grid_thw, got {sorted(data)}")
    grid, pixels = data["image_grid_thw"], data["pixel_values"]
    if grid.numel() != 3:
        raise ValueError(f"image_grid_thw must hold one image's [t, h, w], got shape "
                         f"{tuple(grid.shape)}")
    t, h, w = (int(n) for n in grid.flatten().tolist())
    m = spec.merge_size
    if min(t, h, w) < 1 or h % m or w % m:
        raise ValueError(f"image_grid_thw {[t, h, w]}: h and w must be positive multiples of "
                         f"{m}")
    if tuple(pixels.shape) != (t * h * w, spec.patch_features):
        raise ValueError(f"pixel_values has shape {tuple(pixels.shape)}, expected "
                         f"{(t * h * w, spec.patch_features)} for grid {[t, h, w]}")
    return t, h, w


def _rotary(spec: Qwen2VLVisionSpec, t: int, h: int, w: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [t*h*w, 1, head_dim] of each patch's (row, column), in the
    processor's patch order: merge unit by merge unit, row-major inside each."""
    m = spec.merge_size
    unit_rows = torch.arange(h // m, device=device).view(-1, 1, 1, 1) * m
    unit_cols = torch.arange(w // m, device=device).view(1, -1, 1, 1) * m
    inner = torch.arange(m, device=device)
    shape = (h // m, w // m, m, m)
    rows = (unit_rows + inner.view(1, 1, -1, 1)).expand(shape).flatten()
    cols = (unit_cols + inner.view(1, 1, 1, -1)).expand(shape).flatten()
    half = spec.head_dim // 2
    inv_freq = 1.0 / spec.rope_theta ** (
        torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)
    # The first half of each head turns with the row, the second with the column, and the
    # rotate-half layout repeats both.
    angles = (torch.stack((rows, cols), dim=-1)[..., None].float() * inv_freq).flatten(1)
    angles = torch.cat((angles, angles), dim=-1).repeat(t, 1)[:, None, :]
    return angles.cos(), angles.sin()


def _window_order(spec: Qwen2VLVisionSpec, t: int, h: int, w: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2.5-VL's windows over the merge units: (the unit order that puts each window's
    units together, window by window in row-major order and row-major inside, and the size
    of each window in units). Edge windows are cut short by the frame."""
    side = spec.window_units
    unit_h, unit_w = h // spec.merge_size, w // spec.merge_size
    across, down = -(-unit_w // side), -(-unit_h // side)
    frame = torch.arange(t, device=device).view(-1, 1, 1)
    row = torch.arange(unit_h, device=device).view(1, -1, 1)
    col = torch.arange(unit_w, device=device).view(1, 1, -1)
    window = (frame * down + row // side) * across + col // side
    key = window * side * side + (row % side) * side + col % side
    sizes = torch.bincount(window.flatten(), minlength=t * down * across)
    return torch.argsort(key.flatten()), sizes
