"""Gemma 3's vision side: the SigLIP tower and the multimodal projector, as one
`VisionEncoder` (`ringserve.gpu.multimodal.vision`).

The multimodal seam builds it with `Gemma3VisionEncoder.from_hf_config` for a
`Gemma3ForConditionalGeneration` checkpoint, loads the tensors it `owns` and calls `encode` once
per image on the arrays of transformers' Gemma 3 image processor. Each image (and, with
pan-and-scan, each crop) becomes `mm_tokens_per_image` rows, the embeddings transformers scatters
into that image's `<image_soft_token>` positions.

Checkpoint names: hub checkpoints say `vision_tower.vision_model.*` (this module's layout);
transformers 5 drops the `vision_model.` level (`vision_tower.embeddings.*`), which is put back
here. The tower's attention-pooling head (`...head.*`, present when `vision_use_head` is true)
plays no part in Gemma 3 and is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Self, cast

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.gpu.multimodal.siglip import (
    SiglipSpec,
    SiglipVisionTransformer,
    build_on,
    load_strict,
)

__all__ = ["Gemma3VisionEncoder"]

# transformers' SiglipVisionConfig defaults, for keys a published config.json leaves out.
_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
    "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh",
}
_TOWER = "vision_tower."
_TOWER_MODEL = "vision_tower.vision_model."
_PROJECTOR = "multi_modal_projector."


class Gemma3RMSNorm(nn.Module):
    """Gemma's RMSNorm: scale by (1 + weight), computed in float32 (weights are stored as the
    offset from 1)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., size] -> same, in x's dtype."""
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        # (x * w) is rounded to x's dtype once, after the scale, as transformers does.
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3Projector(nn.Module):
    """Average-pools the tower's patch grid down to `mm_tokens_per_image` tokens, normalises
    them and projects them to the language model's width."""

    def __init__(self, spec: SiglipSpec, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        tokens_per_side = int(tokens_per_image ** 0.5)
        if tokens_per_side ** 2 != tokens_per_image or spec.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image {tokens_per_image} must be a square whose "
                             f"side divides the {spec.patches_per_side} patches per side")
        self.patches_per_side = spec.patches_per_side
        self.kernel = spec.patches_per_side // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(spec.hidden_size, text_hidden))
        self.mm_soft_emb_norm = Gemma3RMSNorm(spec.hidden_size, spec.layer_norm_eps)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[n, patches, vision hidden] -> [n, tokens_per_image, text hidden]."""
        n, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(n, hidden, self.patches_per_side,
                                               self.patches_per_side)
        pooled = F.avg_pool2d(grid, kernel_size=self.kernel, stride=self.kernel)
        tokens = self.mm_soft_emb_norm(pooled.flatten(2).transpose(1, 2))
        return torch.matmul(tokens, self.mm_input_projection_weight).type_as(patches)


class _SiglipVisionModel(nn.Module):
    """The `vision_model.` level of hub checkpoints' names around the tower."""

    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.vision_model = SiglipVisionTransformer(spec)


class Gemma3VisionEncoder(nn.Module):
    """Gemma 3's SigLIP tower and multimodal projector (a `VisionEncoder`)."""

    def __init__(self, spec: SiglipSpec, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        self.spec = spec
        self.tokens_per_image = tokens_per_image
        self.vision_tower = _SiglipVisionModel(spec)
        self.multi_modal_projector = Gemma3Projector(spec, text_hidden, tokens_per_image)

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any], dtype: torch.dtype,
                       device: torch.device) -> Self:
        """The encoder for a checkpoint's config.json (a `Gemma3Config` as a dict), its
        parameters on `device` in `dtype`, uninitialised until `load_weights`.

        Raises:
            ValueError: the config lacks the text model's width, or has a setting this
                encoder does not run.
        """
        spec = SiglipSpec.from_hf(hf_config.get("vision_config") or {}, _VISION_DEFAULTS)
        text_hidden = (hf_config.get("text_config") or {}).get("hidden_size")
        if not isinstance(text_hidden, int):
            raise ValueError("config.json: text_config.hidden_size is missing")
        tokens = int(hf_config.get("mm_tokens_per_image", 256))
        return cast(Self, build_on(lambda: cls(spec, text_hidden, tokens), dtype, device))

    def owns(self, name: str) -> bool:
        """True for the tower's and the projector's tensors (leading `model.` removed)."""
        return name.startswith((_TOWER, _PROJECTOR))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the tower and projector tensors, in either checkpoint naming.

        Raises:
            ValueError: a name matches no parameter, a shape does not fit, or a parameter is
                missing.
        """
        load_strict(self, weights, _canonical)

    def encode(self, data: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings from `{"pixel_values": [crops, 3, S, S]}` (S the tower's
        image_size; one crop without pan-and-scan) -> [crops * mm_tokens_per_image, text
        hidden], crop after crop in the processor's order (the image, then its crops).

        Raises:
            ValueError: pixel_values is missing or not of that shape.
        """
        pixels = data.get("pixel_values")
        size, channels = self.spec.image_size, self.spec.num_channels
        if pixels is None or pixels.dim() != 4 or tuple(pixels.shape[1:]) != (channels, size, size):
            shape = None if pixels is None else list(pixels.shape)
            raise ValueError(f"pixel_values {shape}: expected [crops, {channels}, {size}, {size}]")
        weight = self.multi_modal_projector.mm_input_projection_weight
        with torch.no_grad():
            patches = self.vision_tower.vision_model(pixels.to(weight.device))
            tokens: torch.Tensor = self.multi_modal_projector(patches)
        return tokens.reshape(-1, tokens.shape[-1])


def _canonical(name: str) -> str | None:
    """A checkpoint name -> this module's parameter name; None for the unused pooling head and
    old checkpoints' saved `position_ids` buffer."""
    if name.startswith(_TOWER) and not name.startswith(_TOWER_MODEL):
        name = _TOWER_MODEL + name[len(_TOWER):]
    if name.startswith(_TOWER_MODEL + "head.") or name.endswith("embeddings.position_ids"):
        return None
    return name
