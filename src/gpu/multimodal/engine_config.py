"""What an engine serving images needs, resolved at the edge (`EngineArgs`, `LLM(...)`).

`multimodal_config` reads the checkpoint's family (`ringserve.gpu.multimodal.families`) and
its image processor's settings (`preprocessor_config.json`), checks the user's flags
(`--limit-mm-per-prompt '{"image": N}'`, `--encoder-cache-size`, `--mm-processor-cache-gb`,
`--allowed-local-media-path`, `--allowed-media-domains`, `--media-fetch-timeout`,
`--max-image-pixels`), and returns the frozen `MultiModalConfig`. The encoder budget and the
encoder cache default to `max_num_batched_tokens`, raised to the largest single image's rows
(vLLM's rule), so any image the processor can produce fits one step.

Torch-free.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from ringserve.config import ModelConfig, MultiModalConfig
from ringserve.gpu.multimodal.families import VisionFamily, family_of

logger = logging.getLogger(__name__)


def multimodal_config(
    model_config: ModelConfig, *, max_num_batched_tokens: int,
    limit_mm_per_prompt: str | dict[str, Any] | None = None,
    encoder_cache_size: int | None = None, mm_processor_cache_gb: float = 4.0,
    allowed_local_media_path: str | None = None,
    allowed_media_domains: list[str] | tuple[str, ...] | None = None,
    media_fetch_timeout: float = 10.0, max_image_pixels: int | None = None,
) -> MultiModalConfig | None:
    """The image settings of a vision-language model (None: a text-only model, where a
    limit above zero is refused).

    Raises:
        ValueError: a flag out of range, naming it.
    """
    limit = _image_limit(limit_mm_per_prompt)
    family = family_of(model_config.architecture, model_config.hf_config)
    if family is None:
        if limit:  # a vLLM command line for a text model: as vLLM, the flag does nothing
            logger.warning("--limit-mm-per-prompt has no effect: %s takes text only",
                           model_config.architecture)
        return None
    if encoder_cache_size is not None and encoder_cache_size < 1:
        raise ValueError(f"encoder_cache_size: got {encoder_cache_size}, allowed: >= 1")
    if mm_processor_cache_gb < 0:
        raise ValueError(f"mm_processor_cache_gb: got {mm_processor_cache_gb}, allowed: >= 0")
    if not media_fetch_timeout > 0:
        raise ValueError(f"media_fetch_timeout: got {media_fetch_timeout}, allowed: > 0")
    if max_image_pixels is not None and max_image_pixels < 1:
        raise ValueError(f"max_image_pixels: got {max_image_pixels}, allowed: >= 1")
    if allowed_local_media_path is not None and not Path(allowed_local_media_path).is_dir():
        raise ValueError(f"allowed_local_media_path: {allowed_local_media_path!r} is not a "
                         "directory")
    largest = max_image_rows(family, model_config.hf_config, Path(model_config.model))
    budget = max(max_num_batched_tokens, largest)
    return MultiModalConfig(
        family=family.name,
        limit_per_prompt=1 if limit is None else limit,
        encoder_cache_size=max(encoder_cache_size or budget, largest),
        max_num_encoder_input_tokens=budget,
        no_split=family.no_split,
        max_span=max_num_batched_tokens if family.no_split else 0,
        processor_cache_gb=mm_processor_cache_gb,
        allowed_local_media_path=allowed_local_media_path,
        allowed_media_domains=(tuple(d.lower() for d in allowed_media_domains)
                               if allowed_media_domains is not None else None),
        media_fetch_timeout=media_fetch_timeout,
        max_image_pixels=max_image_pixels,
    )


def _image_limit(value: str | dict[str, Any] | None) -> int | None:
    """The image limit of `--limit-mm-per-prompt` (None: not given)."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value
        try:
            value = json.loads(text)
        except ValueError:
            # vLLM's older form: image=2,video=1
            pairs = [item.partition("=") for item in text.split(",") if item.strip()]
            if not pairs or any(not sep or not v.strip().isdigit() for _, sep, v in pairs):
                raise ValueError(f"limit_mm_per_prompt: {text!r} is neither JSON nor "
                                 "image=N; expected '{\"image\": N}'") from None
            value = {k.strip(): int(v) for k, _, v in pairs}
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt: expected an object such as {{\"image\": 2}}, "
                         f"got {value!r}")
    # Other modalities may be named with a limit of 0 (none), as vLLM command lines do.
    unknown = sorted(k for k, v in value.items() if k != "image" and v not in (0, {"count": 0}))
    if unknown:
        raise ValueError(f"limit_mm_per_prompt: modality {unknown[0]!r} is not supported; "
                         "allowed: image")
    count = value.get("image", 1)
    if isinstance(count, dict):  # vLLM's newer form: {"image": {"count": N, ...}}
        count = count.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"limit_mm_per_prompt.image: got {count!r}, allowed: an integer >= 0")
    return count


def read_processor_config(model_dir: Path) -> dict[str, Any]:
    """The model directory's image processor settings (`preprocessor_config.json`; empty
    when it has none)."""
    path = model_dir / "preprocessor_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def max_image_rows(family: VisionFamily, hf_config: dict[str, Any], model_dir: Path) -> int:
    """The most encoder rows one image can give (the processor's largest output)."""
    processor = read_processor_config(model_dir)
    vision = hf_config.get("vision_config") or {}
    if family.name == "gemma3":
        return int(hf_config.get("mm_tokens_per_image", 256))
    if family.mrope:
        merge = int(vision.get("spatial_merge_size", 2))
        patch = int(vision.get("patch_size", 14))
        size = processor.get("size") or {}
        max_pixels = int(processor.get("max_pixels") or size.get("longest_edge") or 12845056)
        return max(1, max_pixels // (patch * merge) ** 2)
    # Idefics3: tiles of max_image_size, plus the global image, each image_seq_len rows.
    size = int(vision.get("image_size", 512))
    patch = int(vision.get("patch_size", 16))
    scale = int(hf_config.get("scale_factor", 2))
    seq_len = (size // patch) ** 2 // scale**2
    longest = int((processor.get("size") or {}).get("longest_edge", 4 * size))
    tile = int((processor.get("max_image_size") or {}).get("longest_edge", size))
    per_side = math.ceil(longest / tile)
    return (per_side * per_side + 1) * seq_len
