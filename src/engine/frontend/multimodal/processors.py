"""A family's image preprocessing and prompt expansion, as its Hugging Face processor does it.

`ImageProcessor` wraps the model directory's image processor (transformers' PIL classes, which
need neither torchvision nor a video processor: Qwen2.5-VL's processor class insists on one)
and writes, for each image, the text that replaces its placeholder in the prompt:

- Qwen2-VL / Qwen2.5-VL: `<|image_pad|>` repeated once per merged patch (grid t*h*w / merge^2).
- Gemma 3: `\\n\\n<start_of_image>` + `<image_soft_token>` x mm_tokens_per_image +
  `<end_of_image>\\n\\n` (pan-and-scan crops are not taken).
- Idefics3 / SmolVLM: per tile `<fake_token_around_image><row_i_col_j>` + `<image>` x
  image_seq_len, rows ending in a newline, then the global image's
  `<fake_token_around_image><global-img>` + `<image>` x image_seq_len +
  `<fake_token_around_image>` (an unsplit image: the global part alone).

Called by the renderer (`ringserve.engine.frontend.multimodal.renderer`) off the event loop.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ringserve.gpu.multimodal.families import VisionFamily


@dataclass(frozen=True)
class ProcessedImage:
    """One image, ready for the engine.

    Attributes:
        data: the encoder's arrays for this image alone.
        replacement: the prompt text that replaces its placeholder.
        num_embeds: the encoder rows it gives (its image tokens in `replacement`).
        identifier: a content hash of the pixels and the processor's settings.
        nbytes: the arrays' size (the processed-image cache's accounting).
    """

    data: dict[str, np.ndarray[Any, Any]]
    replacement: str
    num_embeds: int
    identifier: str
    nbytes: int


class ImageProcessor:
    """Preprocessing for one model.

    Args:
        family: the model's vision family.
        hf_config: the checkpoint's config (token counts per image).
        model_dir: the directory holding `preprocessor_config.json`.
    """

    def __init__(self, family: VisionFamily, hf_config: dict[str, Any], model_dir: Path) -> None:
        self.family = family
        self.hf_config = hf_config
        self._processor = _load_processor(family, model_dir)
        settings = json.dumps(self._processor.to_dict(), sort_keys=True, default=str)
        self._settings = hashlib.sha256(f"{family.name}\0{settings}".encode()).hexdigest()
        vision = hf_config.get("vision_config") or {}
        self._merge = int(vision.get("spatial_merge_size", 1))
        if family.name == "idefics3":
            size, patch = int(vision.get("image_size", 512)), int(vision.get("patch_size", 16))
            scale = int(hf_config.get("scale_factor", 2))
            self._seq_len = (size // patch) ** 2 // scale**2

    def identifier(self, image_key: str) -> str:
        """The engine's identifier of an image (its content hash `image_key`, processed
        with these settings)."""
        return hashlib.sha256(f"{self._settings}\0{image_key}".encode()).hexdigest()

    def process(self, image: Image.Image, image_key: str) -> ProcessedImage:
        """Preprocess one decoded RGB image whose content hash is `image_key`.

        Raises:
            ValueError: the processor rejects the image (too small for the model, ...).
        """
        name = self.family.name
        if name == "gemma3":
            data, replacement, rows = self._gemma3(image)
        elif name == "idefics3":
            data, replacement, rows = self._idefics3(image)
        else:
            data, replacement, rows = self._qwen2_vl(image)
        nbytes = sum(int(a.nbytes) for a in data.values())
        return ProcessedImage(data, replacement, rows, self.identifier(image_key), nbytes)

    def _qwen2_vl(self, image: Image.Image) -> tuple[dict[str, np.ndarray[Any, Any]], str, int]:
        out = self._processor(images=[image], return_tensors="np")
        grid = np.asarray(out["image_grid_thw"], dtype=np.int64)
        rows = int(grid.prod()) // self._merge**2
        data: dict[str, np.ndarray[Any, Any]] = {
            "pixel_values": np.asarray(out["pixel_values"], dtype=np.float32),
            "image_grid_thw": grid}
        return data, self.family.embed_token * rows, rows

    def _gemma3(self, image: Image.Image) -> tuple[dict[str, np.ndarray[Any, Any]], str, int]:
        out = self._processor(images=[image], return_tensors="np", do_pan_and_scan=False)
        rows = int(self.hf_config.get("mm_tokens_per_image", 256))
        text = f"\n\n<start_of_image>{self.family.embed_token * rows}<end_of_image>\n\n"
        return {"pixel_values": np.asarray(out["pixel_values"], dtype=np.float32)}, text, rows

    def _idefics3(self, image: Image.Image) -> tuple[dict[str, np.ndarray[Any, Any]], str, int]:
        out = self._processor(images=[[image]], return_tensors="np", return_row_col_info=True)
        n_rows, n_cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        tiles = n_rows * n_cols + 1 if n_rows or n_cols else 1
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)[0, :tiles]
        mask = np.asarray(out["pixel_attention_mask"])[0, :tiles].astype(np.bool_)
        seq = self.family.embed_token * self._seq_len
        glob = f"<fake_token_around_image><global-img>{seq}<fake_token_around_image>"
        if tiles == 1:
            text = glob
        else:
            lines = ["".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{seq}"
                             for c in range(n_cols)) + "\n" for r in range(n_rows)]
            text = "".join(lines) + "\n" + glob
        data: dict[str, np.ndarray[Any, Any]] = {"pixel_values": pixels,
                                                 "pixel_attention_mask": mask}
        return data, text, tiles * self._seq_len


_PROCESSORS = {
    "gemma3": ("transformers.models.gemma3.image_processing_pil_gemma3",
               "Gemma3ImageProcessorPil"),
    "idefics3": ("transformers.models.idefics3.image_processing_pil_idefics3",
                 "Idefics3ImageProcessorPil"),
    "qwen2_vl": ("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
                 "Qwen2VLImageProcessorPil"),
}


def _load_processor(family: VisionFamily, model_dir: Path) -> Any:
    """The directory's image processor, as transformers' PIL class of the family."""
    import importlib

    module, name = _PROCESSORS.get(family.name, _PROCESSORS["qwen2_vl"])
    cls: Any = getattr(importlib.import_module(module), name)
    if not (model_dir / "preprocessor_config.json").is_file():
        raise ValueError(f"model directory {model_dir}: no preprocessor_config.json (the image "
                         "processor's settings)")
    return cls.from_pretrained(str(model_dir))
