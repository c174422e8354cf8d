"""The vision-language families ringserve serves, and what each needs of the engine.

One `VisionFamily` per family: the architectures that name it, the token text a chat
template writes for an image (`placeholder`) and the token each embedding row replaces
(`embed_token`), whether its images are computed in one step (`no_split`, Gemma 3's
bidirectional image attention) and whether its positions are M-RoPE's (Qwen2-VL). Read by the
engine's config (`ringserve.engine.arg_utils`), the frontend's renderer and the worker's seam.

Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionFamily:
    """One vision-language family.

    Attributes:
        name: "qwen2_vl", "qwen2_5_vl", "gemma3" or "idefics3".
        architectures: config.json `architectures` served as this family.
        placeholder: the text a chat template (or a prompt) writes for one image.
        embed_token: the token whose positions take the encoder's rows.
        embed_token_keys: config.json keys that may hold `embed_token`'s id, in order.
        no_split: an image is computed in one step (its tokens attend both ways).
        mrope: positions are M-RoPE's (three streams for image tokens).
    """

    name: str
    architectures: tuple[str, ...]
    placeholder: str
    embed_token: str
    embed_token_keys: tuple[str, ...]
    no_split: bool = False
    mrope: bool = False

    def embed_token_id(self, hf_config: dict[str, Any]) -> int:
        """The id of `embed_token` in the model's config.

        Raises:
            ValueError: the config names none.
        """
        for key in self.embed_token_keys:
            value = hf_config.get(key)
            if isinstance(value, int):
                return value
        raise ValueError(f"config.json of a {self.name} model has no image token id "
                         f"({' or '.join(self.embed_token_keys)})")


FAMILIES: tuple[VisionFamily, ...] = (
    VisionFamily("qwen2_vl", ("Qwen2VLForConditionalGeneration",), "<|image_pad|>",
                 "<|image_pad|>", ("image_token_id",), mrope=True),
    VisionFamily("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), "<|image_pad|>",
                 "<|image_pad|>", ("image_token_id",), mrope=True),
    VisionFamily("gemma3", ("Gemma3ForConditionalGeneration",), "<start_of_image>",
                 "<image_soft_token>", ("image_token_id", "image_token_index"), no_split=True),
    VisionFamily("idefics3", ("Idefics3ForConditionalGeneration",), "<image>", "<image>",
                 ("image_token_id",)),
)
VISION_ARCHITECTURES: tuple[str, ...] = tuple(a for f in FAMILIES for a in f.architectures)


def family_named(name: str) -> VisionFamily:
    """The family called `name`.

    Raises:
        ValueError: no such family.
    """
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"vision family {name!r} is unknown; known: "
                     f"{', '.join(f.name for f in FAMILIES)}")


def family_of(architecture: str, hf_config: dict[str, Any]) -> VisionFamily | None:
    """The family of a checkpoint (None: text only; a Gemma 3 checkpoint without a vision
    tower is text only)."""
    for family in FAMILIES:
        if architecture in family.architectures:
            return family if isinstance(hf_config.get("vision_config"), dict) else None
    return None
