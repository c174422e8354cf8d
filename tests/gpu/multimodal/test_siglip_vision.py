"""Gemma 3's and Idefics3's vision encoders against transformers (issue 44): tiny random
models, images of several sizes and aspect ratios through transformers' PIL image processors,
and each encoder's rows equal to the model's own `get_image_features`; checkpoint naming and
the refusals."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from ringserve.gpu.multimodal.gemma3_vision import Gemma3VisionEncoder
from ringserve.gpu.multimodal.idefics3_vision import Idefics3VisionEncoder

CPU = torch.device("cpu")
# image_size 32 / patch 4: an 8 x 8 patch grid.
VISION = {"image_size": 32, "patch_size": 4, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 2}
TEXT_HIDDEN = 48
# (height, width) of the test images: landscape, portrait, small square.
SIZES = [(60, 90), (90, 30), (20, 20)]


def images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def checkpoint(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors as they reach `load_weights`: one leading `model.` removed."""
    return {k.removeprefix("model."): v for k, v in model.state_dict().items()}


def gemma3(vision_use_head: bool = False) -> tuple[Any, dict[str, Any]]:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    # Published checkpoints set vision_use_head false (the pooling head is not saved).
    config = Gemma3Config(
        vision_config={**VISION, "vision_use_head": vision_use_head},
        text_config={"hidden_size": TEXT_HIDDEN, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 24,
                     "vocab_size": 300},
        mm_tokens_per_image=16, boi_token_index=297, eoi_token_index=298, image_token_index=299)
    torch.manual_seed(0)
    return Gemma3ForConditionalGeneration(config).eval(), config.to_dict()


def idefics3() -> tuple[Any, dict[str, Any]]:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    config = Idefics3Config(
        vision_config=VISION,
        text_config={"model_type": "llama", "hidden_size": TEXT_HIDDEN, "intermediate_size": 64,
                     "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "vocab_size": 300},
        scale_factor=2, image_token_id=299)
    torch.manual_seed(1)
    return Idefics3ForConditionalGeneration(config).eval(), config.to_dict()


@pytest.fixture(scope="module")
def gemma3_pair() -> tuple[Any, Gemma3VisionEncoder]:
    model, config = gemma3()
    encoder = Gemma3VisionEncoder.from_hf_config(config, torch.float32, CPU)
    encoder.load_weights((k, v) for k, v in checkpoint(model).items() if encoder.owns(k))
    return model, encoder


@pytest.fixture(scope="module")
def idefics3_pair() -> tuple[Any, Idefics3VisionEncoder]:
    model, config = idefics3()
    encoder = Idefics3VisionEncoder.from_hf_config(config, torch.float32, CPU)
    encoder.load_weights((k, v) for k, v in checkpoint(model).items() if encoder.owns(k))
    return model, encoder


def test_gemma3_matches_transformers(gemma3_pair: tuple[Any, Gemma3VisionEncoder]) -> None:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    model, encoder = gemma3_pair
    processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, do_pan_and_scan=False)
    pixels = processor(images(SIZES), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = model.model.get_image_features(pixels).pooler_output  # [images, 16, hidden]
    for i in range(len(SIZES)):
        got = encoder.encode({"pixel_values": pixels[i:i + 1]})
        assert got.shape == (16, TEXT_HIDDEN)
        torch.testing.assert_close(got, expected[i], atol=1e-5, rtol=1e-5)
    # Several crops (pan-and-scan) in one call: their rows back to back.
    torch.testing.assert_close(encoder.encode({"pixel_values": pixels[:2]}),
                               expected[:2].reshape(-1, TEXT_HIDDEN), atol=1e-5, rtol=1e-5)


def test_gemma3_loads_hub_names_and_skips_the_pooling_head() -> None:
    """Hub checkpoints name the tower `vision_tower.vision_model.*`; transformers 5 drops the
    `vision_model.` level. Both load; the head of a `vision_use_head` tower is skipped."""
    model, config = gemma3(vision_use_head=True)
    tensors = checkpoint(model)
    assert any(".head." in k for k in tensors)
    hub = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v
           for k, v in tensors.items()}
    pixels = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        expected = model.model.get_image_features(pixels).pooler_output[0]
    for names in (tensors, hub):
        encoder = Gemma3VisionEncoder.from_hf_config(config, torch.float32, CPU)
        encoder.load_weights((k, v) for k, v in names.items() if encoder.owns(k))
        torch.testing.assert_close(encoder.encode({"pixel_values": pixels}), expected,
                                   atol=1e-5, rtol=1e-5)


def tile_count(rows: int, cols: int) -> int:
    """An image's tiles: its rows x cols crops and the global image, or just one unsplit."""
    return rows * cols + 1 if rows else 1


def test_idefics3_matches_transformers(
        idefics3_pair: tuple[Any, Idefics3VisionEncoder]) -> None:
    """Images split into 7, 4 and 10 tiles, and one that is not split, batched as the processor
    batches them (padded with all-zero tiles, which transformers drops)."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    model, encoder = idefics3_pair
    assert encoder.image_seq_len == 16
    processor = Idefics3ImageProcessorPil(size={"longest_edge": 96},
                                          max_image_size={"longest_edge": 32})
    split = processor([[im] for im in images(SIZES)], return_tensors="pt",
                      return_row_col_info=True)
    whole = processor([[im] for im in images([(50, 30)], seed=1)], return_tensors="pt",
                      return_row_col_info=True, do_image_splitting=False)
    for batch in (split, whole):
        with torch.no_grad():
            expected = model.model.get_image_features(
                batch["pixel_values"], batch["pixel_attention_mask"]).pooler_output
        for i, (rows, cols) in enumerate(zip(batch["rows"], batch["cols"], strict=True)):
            tiles = tile_count(rows[0], cols[0])
            got = encoder.encode({"pixel_values": batch["pixel_values"][i, :tiles],
                                  "pixel_attention_mask": batch["pixel_attention_mask"][i, :tiles]})
            assert got.shape == (tiles * 16, TEXT_HIDDEN)
            torch.testing.assert_close(got, expected[i], atol=1e-5, rtol=1e-5)
    assert [tile_count(r[0], c[0]) for r, c in zip(split["rows"], split["cols"], strict=True)] \
        == [7, 4, 10]


def test_idefics3_partly_padded_tiles(idefics3_pair: tuple[Any, Idefics3VisionEncoder]) -> None:
    """Tiles whose real pixels cover only part of them (edges off the patch grid too): position
    ids bucketed over the real patches, padded patches not attended to."""
    model, encoder = idefics3_pair
    torch.manual_seed(2)
    mask = torch.ones(3, 32, 32, dtype=torch.long)
    for tile, (h, w) in enumerate([(18, 13), (32, 7), (5, 32)]):
        mask[tile, h:, :] = 0
        mask[tile, :, w:] = 0
    pixels = torch.randn(3, 3, 32, 32) * mask[:, None]
    with torch.no_grad():
        expected = model.model.get_image_features(pixels[None], mask[None]).pooler_output[0]
    got = encoder.encode({"pixel_values": pixels, "pixel_attention_mask": mask})
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Without a mask every pixel counts.
    full = encoder.encode({"pixel_values": pixels})
    torch.testing.assert_close(full, encoder.encode({"pixel_values": pixels,
                                                     "pixel_attention_mask": torch.ones_like(mask)}))


@pytest.mark.parametrize("family", ["gemma3", "idefics3"])
def test_refuses_unknown_missing_and_misshapen_tensors(family: str) -> None:
    model, config = gemma3() if family == "gemma3" else idefics3()
    cls = Gemma3VisionEncoder if family == "gemma3" else Idefics3VisionEncoder
    encoder = cls.from_hf_config(config, torch.float32, CPU)
    owned = {k: v for k, v in checkpoint(model).items() if encoder.owns(k)}
    layer0 = next(k for k in owned if "layers.0.mlp.fc1.weight" in k)

    unknown = layer0.replace("layers.0.", "layers.7.")
    with pytest.raises(ValueError, match=unknown.replace(".", r"\.")):
        encoder.load_weights([*owned.items(), (unknown, owned[layer0])])
    with pytest.raises(ValueError, match=r"lacks 1 tensors .*layers\.0\.mlp\.fc1\.weight"):
        encoder.load_weights((k, v) for k, v in owned.items() if k != layer0)
    with pytest.raises(ValueError, match=r"\[64, 31\], expected .*\[64, 32\]"):
        encoder.load_weights({**owned, layer0: owned[layer0][:, :31]}.items())


def test_owns_only_its_tensors() -> None:
    _, g_config = gemma3()
    _, i_config = idefics3()
    g = Gemma3VisionEncoder.from_hf_config(g_config, torch.float32, CPU)
    i = Idefics3VisionEncoder.from_hf_config(i_config, torch.float32, CPU)
    assert g.owns("vision_tower.vision_model.post_layernorm.weight")
    assert g.owns("multi_modal_projector.mm_soft_emb_norm.weight")
    assert not g.owns("language_model.embed_tokens.weight")
    assert i.owns("vision_model.post_layernorm.weight")
    assert i.owns("connector.modality_projection.proj.weight")
    assert not i.owns("text_model.embed_tokens.weight")
    assert not i.owns("lm_head.weight")


def test_encode_refuses_bad_arrays(gemma3_pair: tuple[Any, Gemma3VisionEncoder],
                                   idefics3_pair: tuple[Any, Idefics3VisionEncoder]) -> None:
    g, i = gemma3_pair[1], idefics3_pair[1]
    with pytest.raises(ValueError, match=r"expected \[crops, 3, 32, 32\]"):
        g.encode({"pixel_values": torch.zeros(1, 3, 28, 28)})
    with pytest.raises(ValueError, match="pixel_values None"):
        g.encode({})
    with pytest.raises(ValueError, match="square"):
        i.encode({"pixel_values": torch.zeros(1, 3, 32, 24)})
    with pytest.raises(ValueError, match="pixel_attention_mask"):
        i.encode({"pixel_values": torch.zeros(2, 3, 32, 32),
                  "pixel_attention_mask": torch.ones(1, 32, 32)})
    with pytest.raises(ValueError, match="no real pixel"):
        i.encode({"pixel_values": torch.zeros(1, 3, 32, 32),
                  "pixel_attention_mask": torch.zeros(1, 32, 32)})
