"""Vision-language models: a family's language model with its vision tower beside it.

Each class is the text model ringserve already serves (Qwen2 for Qwen2-VL and Qwen2.5-VL,
Gemma 3 text for Gemma 3, Llama for Idefics3 / SmolVLM) plus a `vision` attribute holding the
family's `VisionEncoder`. `load_weights` splits the checkpoint: the tower's tensors (one leading
`model.` removed) go to the encoder, the language model's are renamed from the checkpoint's
layout (transformers 5's `model.language_model.*`, older `model.*` / `language_model.model.*`)
onto the text model's names. The model runner reaches the tower through `vision_of` and the
image seam through `image_seam`; the registry (`ringserve.gpu.models.registry`) lists the
classes.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch

from ringserve.config import EngineConfig, ModelConfig
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.models.gemma import Gemma3ForCausalLM
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.models.qwen import Qwen2ForCausalLM
from ringserve.gpu.multimodal.families import family_named
from ringserve.gpu.multimodal.runner_seam import ImageSeam
from ringserve.gpu.multimodal.vision import VisionEncoder


class _VisionLanguage(LlamaForCausalLM):
    """The shared part: the tower beside the text model, and the checkpoint split."""

    # (checkpoint prefix, text model prefix), tried in order.
    TEXT_PREFIXES: ClassVar[tuple[tuple[str, str], ...]] = ()
    # The family's encoder, "module:Class" (imported when a checkpoint has a tower), and the
    # checkpoint's own model type where the encoder reads it (the merged config carries its
    # text model's).
    VISION_ENCODER: ClassVar[str]
    MODEL_TYPE: ClassVar[str | None] = None

    @property
    def vision_encoder(self) -> VisionEncoder | None:
        """The tower (a submodule named `vision`), or None for a text-only checkpoint."""
        vision = self._modules.get("vision")
        return vision  # type: ignore[return-value]

    @classmethod
    def from_config(cls, config: ModelConfig, tp: TPGroup,
                    backend: AttentionBackend) -> LlamaForCausalLM:
        """The text model, with the family's tower when the checkpoint has one."""
        model = super().from_config(config, tp, backend)
        assert isinstance(model, _VisionLanguage)
        if isinstance(config.hf_config.get("vision_config"), dict):
            vision = cls.build_vision(config.hf_config, config.dtype)
            assert isinstance(vision, torch.nn.Module)
            model.add_module("vision", vision)
        return model

    @classmethod
    def build_vision(cls, hf_config: dict[str, Any], dtype: str) -> VisionEncoder:
        """The family's vision encoder (on the current default device)."""
        module, name = cls.VISION_ENCODER.split(":")
        encoder: Any = getattr(importlib.import_module(module), name)
        if cls.MODEL_TYPE is not None:
            hf_config = {**hf_config, "model_type": cls.MODEL_TYPE}
        vision: VisionEncoder = encoder.from_hf_config(hf_config, _dtype(dtype), _device())
        return vision

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The tower's tensors to the encoder, the rest renamed to the text model."""
        vision = self.vision_encoder
        tower: list[tuple[str, torch.Tensor]] = []

        def text() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                short = name[len("model."):] if name.startswith("model.") else name
                if vision is not None and vision.owns(short):
                    # The reader reuses its buffer for the next tensor: keep a copy.
                    tower.append((short, tensor.clone()))
                    continue
                if vision is None and _is_tower(short):
                    continue  # a checkpoint served as text only
                for old, new in self.TEXT_PREFIXES:
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                yield name, tensor

        super().load_weights(text())
        if vision is not None:
            vision.load_weights(tower)

    def _expected_shards(self) -> set[tuple[str, int]]:
        # The tower checks its own tensors (`VisionEncoder.load_weights`).
        return {(n, s) for n, s in super()._expected_shards() if not n.startswith("vision.")}


_TOWER_PREFIXES = ("visual.", "vision_tower.", "multi_modal_projector.", "vision_model.",
                   "connector.")


def _is_tower(name: str) -> bool:
    return name.startswith(_TOWER_PREFIXES)


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name)
    assert isinstance(value, torch.dtype)
    return value


def _device() -> torch.device:
    return torch.empty(0).device  # the loader builds models under `with torch.device(...)`


class Qwen2VLForConditionalGeneration(_VisionLanguage, Qwen2ForCausalLM):
    """Qwen2-VL: Qwen2 with M-RoPE, and its vision tower."""

    TEXT_PREFIXES = (("model.language_model.", "model."),)
    VISION_ENCODER = "ringserve.gpu.multimodal.qwen2_vl:Qwen2VLVisionEncoder"
    MODEL_TYPE = "qwen2_vl"


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: as Qwen2-VL, with the windowed tower."""

    MODEL_TYPE = "qwen2_5_vl"


class Gemma3ForConditionalGeneration(_VisionLanguage, Gemma3ForCausalLM):
    """Gemma 3 (4B and up): Gemma 3 text, its SigLIP tower and projector. A checkpoint
    without a vision config is served as text."""

    TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."))
    VISION_ENCODER = "ringserve.gpu.multimodal.gemma3_vision:Gemma3VisionEncoder"


class Idefics3ForConditionalGeneration(_VisionLanguage, LlamaForCausalLM):
    """Idefics3 / SmolVLM: Llama, its SigLIP-style tower and pixel-shuffle connector."""

    TEXT_PREFIXES = (("model.text_model.", "model."),)
    VISION_ENCODER = "ringserve.gpu.multimodal.idefics3_vision:Idefics3VisionEncoder"


VISION_MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
}


def vision_of(model: LlamaForCausalLM) -> VisionEncoder:
    """The loaded model's vision encoder.

    Raises:
        ValueError: the model has none (a text-only checkpoint given images).
    """
    vision = model.vision_encoder if isinstance(model, _VisionLanguage) else None
    if vision is None:
        raise ValueError(f"{type(model).__name__} has no vision tower")
    return vision


def image_seam(config: EngineConfig, device: torch.device) -> ImageSeam | None:
    """The model runner's image seam for a vision-language model (None: text only)."""
    mm = config.multimodal_config
    if mm is None:
        return None
    return ImageSeam(family_named(mm.family), config.model_config.hf_config, device)
