"""The renderer (`ringserve.engine.frontend.multimodal.renderer`) for each family of tiny
model: each image's placeholder expanded into its tokens and located in the prompt (text and
token-id prompts alike), placeholder mismatches refused, the processed-image cache counted,
and identifiers that follow the pixels, not their encoding."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from ringserve.config import ModelConfig
from ringserve.engine.frontend.multimodal.renderer import ImageRenderer
from ringserve.gpu.multimodal.engine_config import multimodal_config
from ringserve.gpu.multimodal.testing import FAMILIES, tiny_vlm

pytestmark = pytest.mark.slow  # builds the tiny models on a cold cache

# Per family and image size: (encoder rows, positions from the first image token to the last).
EXPECTED = {
    "qwen2_vl": {(60, 80): (6, 6), (112, 140): (20, 20)},
    "qwen2_5_vl": {(60, 80): (6, 6), (112, 140): (20, 20)},
    "gemma3": {(60, 80): (4, 4), (112, 140): (4, 4)},
    "idefics3": {(60, 80): (20, 31), (112, 140): (20, 31)},  # 4 tiles + the global image
}


def image(h: int, w: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


_RENDERERS: dict[str, ImageRenderer] = {}


def renderer(family: str, cache_gb: float = 1.0) -> ImageRenderer:
    from transformers import AutoTokenizer

    path = tiny_vlm(family)
    model = ModelConfig.from_model_dir(str(path))
    config = multimodal_config(model, max_num_batched_tokens=64,
                               limit_mm_per_prompt={"image": 2},
                               mm_processor_cache_gb=cache_gb)
    assert config is not None
    return ImageRenderer(model, config, AutoTokenizer.from_pretrained(str(path)))


@pytest.fixture(params=FAMILIES)
def family_renderer(request: pytest.FixtureRequest) -> ImageRenderer:
    family = str(request.param)
    if family not in _RENDERERS:
        _RENDERERS[family] = renderer(family)
    return _RENDERERS[family]


def test_expansion_and_positions(family_renderer: ImageRenderer) -> None:
    r = family_renderer
    sizes = [(60, 80), (112, 140)]
    images = [r.process(image(h, w, i)) for i, (h, w) in enumerate(sizes)]
    text = f"look {r.family.placeholder} and {r.family.placeholder} now"
    ids, features = r.render_text(text, images, add_special_tokens=True)
    assert len(features) == 2
    for size, processed, feature in zip(sizes, images, features, strict=True):
        rows, length = EXPECTED[r.family.name][size]
        assert (processed.num_embeds, feature.num_embeds, feature.length) == (rows, rows, length)
        assert feature.identifier == processed.identifier
        span = ids[feature.offset:feature.end]
        assert span[0] == span[-1] == r.embed_token_id
        assert span.count(r.embed_token_id) == rows
    assert features[0].end <= features[1].offset
    assert ids.count(r.embed_token_id) == sum(EXPECTED[r.family.name][s][0] for s in sizes)
    # The same prompt given as token ids: the same tokens and positions.
    raw = list(r.tokenizer(text, add_special_tokens=True).input_ids)
    again, located = r.render_tokens(raw, images)
    assert again == ids
    assert [(f.offset, f.length) for f in located] == [(f.offset, f.length) for f in features]


def test_placeholder_mismatch_is_refused(family_renderer: ImageRenderer) -> None:
    r = family_renderer
    one = [r.process(image(60, 80))]
    with pytest.raises(ValueError, match=r"holds 2 image placeholders .* for 1 images"):
        r.render_text(f"{r.family.placeholder} {r.family.placeholder}", one,
                      add_special_tokens=True)
    with pytest.raises(ValueError, match="holds 0 image placeholders"):
        r.render_text("no image here", one, add_special_tokens=True)
    with pytest.raises(ValueError, match="prompt_token_ids hold 0 image placeholders"):
        r.render_tokens([1, 2, 3], one)


def test_image_tokens_written_in_the_text_are_refused(family_renderer: ImageRenderer) -> None:
    r = family_renderer
    one = [r.process(image(60, 80))]
    ids, _ = r.render_text(r.family.placeholder, one, add_special_tokens=False)
    with pytest.raises(ValueError, match="image tokens where its images need"):
        r.locate([r.embed_token_id, *ids], one)


def test_repeated_image_hits_the_processed_cache() -> None:
    r = renderer("qwen2_vl")
    first = r.process(image(60, 80, 1))
    assert (r.cache_queries, r.cache_hits) == (1, 0)
    again = r.process(image(60, 80, 1))
    assert (r.cache_queries, r.cache_hits) == (2, 1)
    assert again is first
    r.process(image(60, 80, 2))
    assert (r.cache_queries, r.cache_hits) == (3, 1)


def test_a_zero_sized_cache_keeps_nothing() -> None:
    r = renderer("gemma3", cache_gb=0)
    r.process(image(60, 80, 1))
    r.process(image(60, 80, 1))
    assert (r.cache_queries, r.cache_hits) == (2, 0)


def _encoded(im: Image.Image, fmt: str, **kw: object) -> Image.Image:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    buf.seek(0)
    return Image.open(buf)


def test_identical_pixels_from_different_encodings_share_an_identifier() -> None:
    r = renderer("idefics3")
    pixels = image(40, 50, 3)
    png = r.load(_encoded(pixels, "PNG"))
    bmp = r.load(_encoded(pixels, "BMP"))
    rgba = r.load(pixels.convert("RGBA"))  # opaque alpha: the same RGB
    ids = {r.process(x).identifier for x in (pixels, png, bmp, rgba)}
    assert len(ids) == 1
    other = r.process(image(40, 50, 4)).identifier
    assert other not in ids
    # The same pixels under another family's processor are another image to the engine.
    assert renderer("gemma3").process(pixels).identifier not in ids


def test_a_non_image_object_is_refused() -> None:
    r = renderer("gemma3")
    with pytest.raises(ValueError, match="expected a PIL image or an image URL, got bytes"):
        r.load(b"\x89PNG")
