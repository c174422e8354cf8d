"""Idefics3's (and SmolVLM's) vision side: the SigLIP-style tower over image tiles and the
pixel-shuffle connector, as one `VisionEncoder` (`ringserve.gpu.multimodal.vision`).

The multimodal seam builds it with `Idefics3VisionEncoder.from_hf_config` for an
`Idefics3ForConditionalGeneration` checkpoint, loads the tensors it `owns` and calls `encode`
once per image on that image's real tiles from transformers' Idefics3 image processor (which
pads a batch with all-zero tiles; transformers drops those and so must the caller). Each tile
becomes `image_seq_len` rows, tile after tile, the order in which the processor's prompt lists
them (the row-major crops, then the downscaled global image).

Checkpoint names (`vision_model.*`, `connector.*`) are the same in transformers 4 and 5.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Self, cast

import torch
from torch import nn

from ringserve.gpu.multimodal.siglip import (
    SiglipSpec,
    SiglipVisionTransformer,
    build_on,
    load_strict,
)

__all__ = ["Idefics3VisionEncoder"]

# transformers' Idefics3VisionConfig defaults, for keys a published config.json leaves out.
_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 16, "num_channels": 3, "image_size": 224, "patch_size": 32,
    "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh",
}
_OWNED = ("vision_model.", "connector.")


class Idefics3SimpleMLP(nn.Module):
    """The connector's projection (`connector.modality_projection.proj`, no bias)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., out]."""
        out: torch.Tensor = self.proj(x)
        return out


class Idefics3Connector(nn.Module):
    """Pixel shuffle (each scale x scale block of patches becomes one token, its features
    concatenated) and the projection to the language model's width."""

    def __init__(self, spec: SiglipSpec, text_hidden: int, scale_factor: int) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = Idefics3SimpleMLP(spec.hidden_size * scale_factor ** 2,
                                                     text_hidden)

    def forward(self, patches: torch.Tensor, side: int) -> torch.Tensor:
        """[n, side * side, hidden] -> [n, (side / scale) ** 2, text hidden].

        The token for block (I, J) concatenates patches (I*s + r, J*s + c) in (r, c) order,
        the layout transformers' two-step view/permute pixel shuffle produces.
        """
        n, _, hidden = patches.shape
        s = self.scale_factor
        blocks = patches.reshape(n, side // s, s, side // s, s, hidden).permute(0, 1, 3, 2, 4, 5)
        out: torch.Tensor = self.modality_projection(
            blocks.reshape(n, (side // s) ** 2, s * s * hidden))
        return out


class Idefics3VisionEncoder(nn.Module):
    """Idefics3's vision transformer and connector (a `VisionEncoder`)."""

    def __init__(self, spec: SiglipSpec, text_hidden: int, scale_factor: int) -> None:
        super().__init__()
        if spec.patches_per_side % scale_factor:
            raise ValueError(f"scale_factor {scale_factor} does not divide the "
                             f"{spec.patches_per_side} patches per side")
        self.spec = spec
        self.vision_model = SiglipVisionTransformer(spec)
        self.connector = Idefics3Connector(spec, text_hidden, scale_factor)

    @property
    def image_seq_len(self) -> int:
        """Rows per tile (the processor's `image_seq_len`: image tokens per tile in the
        prompt)."""
        return (self.spec.patches_per_side // self.connector.scale_factor) ** 2

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any], dtype: torch.dtype,
                       device: torch.device) -> Self:
        """The encoder for a checkpoint's config.json (an `Idefics3Config` as a dict), its
        parameters on `device` in `dtype`, uninitialised until `load_weights`.

        Raises:
            ValueError: the config lacks the text model's width, or has a setting this
                encoder does not run.
        """
        spec = SiglipSpec.from_hf(hf_config.get("vision_config") or {}, _VISION_DEFAULTS)
        text_hidden = (hf_config.get("text_config") or {}).get("hidden_size")
        if not isinstance(text_hidden, int):
            raise ValueError("config.json: text_config.hidden_size is missing")
        scale = int(hf_config.get("scale_factor", 2))
        return cast(Self, build_on(lambda: cls(spec, text_hidden, scale), dtype, device))

    def owns(self, name: str) -> bool:
        """True for the vision transformer's and the connector's tensors (leading `model.`
        removed)."""
        return name.startswith(_OWNED)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the vision transformer and connector tensors.

        Raises:
            ValueError: a name matches no parameter, a shape does not fit, or a parameter is
                missing.
        """
        load_strict(self, weights, _canonical)

    def encode(self, data: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings from its real tiles: `{"pixel_values": [tiles, 3, H, W],
        "pixel_attention_mask": [tiles, H, W]}` (the mask optional: all real without it) ->
        [tiles * image_seq_len, text hidden], tile after tile.

        H = W is the processor's tile size (`max_image_size`, the tower's image_size in
        published checkpoints). A patch is real when any of its pixels is; real patches' position
        ids are bucketed over the whole table, padded ones are not attended to.

        Raises:
            ValueError: the arrays' shapes do not fit, or a tile has no real pixel.
        """
        pixels, mask = self._checked(data)
        device = self.connector.modality_projection.proj.weight.device
        patch = self.spec.patch_size
        side = pixels.shape[-1] // patch
        grid = mask[:, :side * patch, :side * patch].to(device=device, dtype=torch.bool)
        patch_mask = grid.reshape(-1, side, patch, side, patch).any(dim=4).any(dim=2)
        if not bool(patch_mask.flatten(1).any(dim=1).all()):
            raise ValueError("pixel_attention_mask: a tile has no real pixel (drop padding "
                             "tiles before encoding)")
        with torch.no_grad():
            patches = self.vision_model(pixels.to(device), patch_mask)
            tokens: torch.Tensor = self.connector(patches, side)
        return tokens.reshape(-1, tokens.shape[-1])

    def _checked(self, data: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """pixel_values and its mask (all ones when absent), validated."""
        pixels = data.get("pixel_values")
        channels = self.spec.num_channels
        if pixels is None or pixels.dim() != 4 or pixels.shape[1] != channels:
            shape = None if pixels is None else list(pixels.shape)
            raise ValueError(f"pixel_values {shape}: expected [tiles, {channels}, H, W]")
        tiles, _, height, width = pixels.shape
        side, rest = divmod(height // self.spec.patch_size, self.connector.scale_factor)
        # The connector folds the patch grid as a square; transformers assumes the same.
        if height != width or side == 0 or rest:
            raise ValueError(f"pixel_values {list(pixels.shape)}: tiles must be square with "
                             f"a patch grid divisible by scale_factor "
                             f"{self.connector.scale_factor}")
        mask = data.get("pixel_attention_mask")
        if mask is None:
            return pixels, torch.ones(tiles, height, width, dtype=torch.bool)
        if tuple(mask.shape) != (tiles, height, width):
            raise ValueError(f"pixel_attention_mask {list(mask.shape)}: expected "
                             f"{[tiles, height, width]}")
        return pixels, mask


def _canonical(name: str) -> str | None:
    """A checkpoint name -> this module's parameter name; None for old checkpoints' saved
    `position_ids` buffer."""
    return None if name.endswith("embeddings.position_ids") else name
