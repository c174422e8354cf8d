"""The Qwen2-VL / Qwen2.5-VL vision encoder against transformers' own towers.

Tiny random-weight `Qwen2VLForConditionalGeneration` / `Qwen2_5_VLForConditionalGeneration`
models are the oracle: their checkpoint tensors load into `Qwen2VLVisionEncoder`, and its
`encode` must give the rows `get_image_features` gives for each image. Qwen2.5-VL's windows
(2 x 2 merged tokens here) cut the larger images into several, some partial, and its middle
block attends over the whole image, so both attention kinds are covered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoModelForImageTextToText,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

from ringserve.gpu.multimodal.qwen2_vl import Qwen2VLVisionEncoder
from ringserve.gpu.multimodal.vision import VisionEncoder

_TEXT: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128,
    "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e4},
}
_VISION: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                 "mlp_ratio": 2},
    # window_size 56 px = 2 x 2 merged tokens; block 1 of 3 attends over the whole image.
    "qwen2_5_vl": {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                   "out_hidden_size": 64, "window_size": 56, "fullatt_block_indexes": [1]},
}
# PIL sizes (width, height): grids of 4x4, 6x10 and 14x8 patches once resized to multiples
# of 28; the last two leave partial windows on the right or at the bottom.
_IMAGE_SIZES = [(56, 56), (140, 84), (120, 200)]


def _hf_model(model_type: str) -> PreTrainedModel:
    vision = _VISION[model_type]
    model: PreTrainedModel
    if model_type == "qwen2_vl":
        model = Qwen2VLForConditionalGeneration(
            Qwen2VLConfig(vision_config=vision, text_config=_TEXT))
    else:
        model = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(vision_config=vision, text_config=_TEXT))
    # transformers initialises norms to ones and zeros and linears at std 0.02, which would
    # hide a swapped scale or bias; draw everything so each parameter shapes the output.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            fan_in = param[0].numel() if param.ndim > 1 else 16
            param.copy_(torch.randn(param.shape, generator=generator) * fan_in**-0.5)
    model.eval()
    return model


def _checkpoint(model: PreTrainedModel) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors as the runner hands them over: one leading `model.` removed."""
    return [(name.removeprefix("model."), tensor) for name, tensor in model.state_dict().items()]


def _encoder(model: PreTrainedModel) -> Qwen2VLVisionEncoder:
    encoder = Qwen2VLVisionEncoder.from_hf_config(model.config.to_dict(), torch.float32,
                                                  torch.device("cpu"))
    encoder.load_weights((n, t) for n, t in _checkpoint(model) if encoder.owns(n))
    return encoder


def _image(size: tuple[int, int], seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8)
    return Image.fromarray(pixels)


def _reference(model: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values, grid).pooler_output
    assert len(features) == 1
    out: torch.Tensor = features[0]
    return out


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def hf_model(request: pytest.FixtureRequest) -> PreTrainedModel:
    model_type: str = request.param
    return _hf_model(model_type)


def test_is_a_vision_encoder(hf_model: PreTrainedModel) -> None:
    encoder: VisionEncoder = _encoder(hf_model)
    assert encoder.owns("visual.blocks.0.attn.qkv.weight")
    assert not encoder.owns("language_model.layers.0.mlp.up_proj.weight")
    assert not encoder.owns("lm_head.weight")


@pytest.mark.parametrize("size", _IMAGE_SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_encode_matches_transformers(hf_model: PreTrainedModel, size: tuple[int, int]) -> None:
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=200 * 200)
    arrays = processor(images=[_image(size, seed=sum(size))], return_tensors="pt")
    pixel_values, grid = arrays["pixel_values"], arrays["image_grid_thw"]
    expected = _reference(hf_model, pixel_values, grid)

    got = _encoder(hf_model).encode({"pixel_values": pixel_values, "image_grid_thw": grid})

    assert got.shape == (int(grid.prod()) // 4, 64)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_encode_in_bfloat16_follows_transformers(hf_model: PreTrainedModel,
                                                  tmp_path: Path) -> None:
    """Loaded as a checkpoint is (`.to(bfloat16)` would also round transformers' float32
    rotary frequencies), transformers' tower and the encoder differ by at most a bfloat16
    rounding step here and there: the patch embedding is a matmul here, a Conv3d there."""
    hf_model.save_pretrained(tmp_path)
    model = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=200 * 200)
    arrays = processor(images=[_image((120, 200), seed=3)], return_tensors="pt")
    pixel_values, grid = arrays["pixel_values"], arrays["image_grid_thw"]
    expected = _reference(model, pixel_values, grid)
    encoder = Qwen2VLVisionEncoder.from_hf_config(model.config.to_dict(), torch.bfloat16,
                                                  torch.device("cpu"))
    encoder.load_weights((n, t) for n, t in _checkpoint(model) if encoder.owns(n))

    got = encoder.encode({"pixel_values": pixel_values, "image_grid_thw": grid})

    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=8e-3, rtol=1.6e-2)


def test_encode_matches_transformers_on_several_frames(hf_model: PreTrainedModel) -> None:
    """A two-frame grid (a clip's shape): each frame attends only to itself."""
    grid = torch.tensor([[2, 6, 10]])
    pixel_values = torch.randn(120, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    expected = _reference(hf_model, pixel_values, grid)

    got = _encoder(hf_model).encode({"pixel_values": pixel_values, "image_grid_thw": grid})

    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_encode_refuses_pixels_that_disagree_with_the_grid(hf_model: PreTrainedModel) -> None:
    encoder = _encoder(hf_model)
    with pytest.raises(ValueError, match="pixel_values has shape"):
        encoder.encode({"pixel_values": torch.zeros(15, 1176),
                        "image_grid_thw": torch.tensor([[1, 4, 4]])})


def test_load_weights_refuses_an_unknown_tensor(hf_model: PreTrainedModel) -> None:
    encoder = Qwen2VLVisionEncoder.from_hf_config(hf_model.config.to_dict(), torch.float32,
                                                  torch.device("cpu"))
    weights = [(n, t) for n, t in _checkpoint(hf_model) if encoder.owns(n)]
    weights.append(("visual.blocks.9.attn.qkv.weight", torch.zeros(96, 32)))
    with pytest.raises(ValueError, match=r"'visual\.blocks\.9\.attn\.qkv\.weight'"):
        encoder.load_weights(weights)


def test_load_weights_refuses_a_missing_tensor(hf_model: PreTrainedModel) -> None:
    encoder = Qwen2VLVisionEncoder.from_hf_config(hf_model.config.to_dict(), torch.float32,
                                                  torch.device("cpu"))
    weights = [(n, t) for n, t in _checkpoint(hf_model)
               if encoder.owns(n) and n != "visual.merger.mlp.2.bias"]
    with pytest.raises(ValueError, match=r"visual\.merger\.mlp\.2\.bias"):
        encoder.load_weights(weights)


def test_load_weights_refuses_a_tensor_of_the_wrong_shape(hf_model: PreTrainedModel) -> None:
    encoder = Qwen2VLVisionEncoder.from_hf_config(hf_model.config.to_dict(), torch.float32,
                                                  torch.device("cpu"))
    weights = [(n, t[:-1] if n == "visual.blocks.0.attn.proj.bias" else t)
               for n, t in _checkpoint(hf_model) if encoder.owns(n)]
    with pytest.raises(ValueError, match=r"'visual\.blocks\.0\.attn\.proj\.bias' has shape"):
        encoder.load_weights(weights)


def test_from_hf_config_refuses_another_family() -> None:
    with pytest.raises(ValueError, match="qwen2_vl or qwen2_5_vl"):
        Qwen2VLVisionEncoder.from_hf_config({"model_type": "llama"}, torch.float32,
                                            torch.device("cpu"))
