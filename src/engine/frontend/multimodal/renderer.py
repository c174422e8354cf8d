"""The renderer: a prompt's images in, token ids and `ImageFeature`s out.

One `ImageRenderer` per frontend engine client (`AsyncLLM`, `LLMEngine`). It loads image URLs
under the media policy (`media.py`), preprocesses each image with the family's processor
(`processors.py`) through a processed-image cache keyed by the image's content hash
(`--mm-processor-cache-gb`; counted as vLLM's `mm_cache_queries` / `mm_cache_hits`), expands
each image's placeholder in the prompt text into the image's tokens, tokenizes, and finds each
image's positions. Every method is blocking and thread-safe: `AsyncLLM` runs them in worker
threads (`trio.to_thread`, at most `RENDER_THREADS` at once), never on the event loop.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ringserve.config import ModelConfig, MultiModalConfig
from ringserve.engine.frontend.multimodal.media import (
    MediaError,
    MediaPolicy,
    image_hash,
    load_image,
    to_rgb,
)
from ringserve.engine.frontend.multimodal.processors import ImageProcessor, ProcessedImage
from ringserve.gpu.multimodal.families import family_named
from ringserve.gpu.multimodal.features import ImageFeature

# Worker threads preprocessing images at once per frontend: numpy and Pillow release the GIL
# for their heavy loops, and more threads than cores only contend (vLLM #58266).
RENDER_THREADS = 2
# data: URLs remembered by digest (a few MB of keys at most).
_URL_ENTRIES = 16384


class ImageRenderer:
    """Images of prompts for one model (see the module docstring).

    Args:
        model_config: the model (its directory and config).
        config: the engine's image settings.
        tokenizer: the model's tokenizer.
    """

    def __init__(self, model_config: ModelConfig, config: MultiModalConfig,
                 tokenizer: Any) -> None:
        self.family = family_named(config.family)
        self.config = config
        self.tokenizer = tokenizer
        self._model_config = model_config
        self._processor: ImageProcessor | None = None
        self.embed_token_id = self.family.embed_token_id(model_config.hf_config)
        self.policy = MediaPolicy(
            allowed_local_media_path=config.allowed_local_media_path,
            allowed_media_domains=config.allowed_media_domains,
            fetch_timeout=config.media_fetch_timeout,
            max_image_pixels=config.max_image_pixels)
        self._capacity = int(config.processor_cache_gb * (1 << 30))
        self._cache: OrderedDict[str, ProcessedImage] = OrderedDict()
        # data: URL digest -> the image's content hash: a data: URL holds its bytes, so the
        # same URL again skips decoding and hashing the pixels (the repeated image's TTFT).
        self._by_url: OrderedDict[str, str] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self.cache_queries = 0
        self.cache_hits = 0

    @property
    def processor(self) -> ImageProcessor:
        """The family's processor, loaded on first use (or by `warm_up`)."""
        if self._processor is None:
            with self._lock:
                if self._processor is None:
                    cfg = self._model_config
                    self._processor = ImageProcessor(self.family, cfg.hf_config,
                                                     Path(cfg.model))
        return self._processor

    def warm_up(self) -> float:
        """Load the processor and run it once on a blank 640x480 image (transformers'
        modules imported, first-call costs paid), off the event loop while the engine core
        loads the model; returns the seconds it took. Nothing is cached or counted."""
        start = time.perf_counter()
        self.processor.process(Image.new("RGB", (640, 480)), "warm-up")
        return time.perf_counter() - start

    # -- images ---------------------------------------------------------------------------------

    def load(self, source: Any) -> Image.Image:
        """A decoded RGB image from a URL string or a PIL image.

        Raises:
            MediaError: a URL that cannot be used, or an object that is not an image.
        """
        if isinstance(source, str):
            return load_image(source, self.policy)
        if isinstance(source, Image.Image):
            return to_rgb(source)
        raise MediaError(f"expected a PIL image or an image URL, got {type(source).__name__}")

    def load_processed(self, source: Any) -> ProcessedImage:
        """`process(load(source))`, with a data: URL sent before found by the URL alone.

        Raises:
            MediaError: as `load` and `process`.
        """
        if not (isinstance(source, str) and source.startswith("data:") and self._capacity):
            return self.process(self.load(source))
        digest = hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()
        with self._lock:
            key = self._by_url.get(digest)
            hit = self._cache.get(key) if key is not None else None
            if hit is not None:
                assert key is not None
                self.cache_queries += 1
                self.cache_hits += 1
                self._cache.move_to_end(key)
                self._by_url.move_to_end(digest)
                return hit
        image = self.load(source)
        key = image_hash(image)
        processed = self._process_keyed(image, key)
        with self._lock:
            self._by_url[digest] = key
            while len(self._by_url) > _URL_ENTRIES:
                self._by_url.popitem(last=False)
        return processed

    def process(self, image: Image.Image) -> ProcessedImage:
        """The processed image, from the cache when the same pixels came before.

        Raises:
            ValueError: the processor rejects it.
        """
        return self._process_keyed(image, image_hash(image))

    def _process_keyed(self, image: Image.Image, key: str) -> ProcessedImage:
        with self._lock:
            self.cache_queries += 1
            hit = self._cache.get(key)
            if hit is not None:
                self.cache_hits += 1
                self._cache.move_to_end(key)
                return hit
        try:
            processed = self.processor.process(image, key)
        except (ValueError, TypeError) as exc:
            raise MediaError(f"the image processor rejected the image: {exc}") from None
        with self._lock:
            if self._capacity and processed.nbytes <= self._capacity and key not in self._cache:
                self._cache[key] = processed
                self._cached_bytes += processed.nbytes
                while self._cached_bytes > self._capacity:
                    _, old = self._cache.popitem(last=False)
                    self._cached_bytes -= old.nbytes
        return processed

    def take_cache_stats(self) -> tuple[int, int]:
        """Processed-image cache queries and hits since the last call (the metrics)."""
        with self._lock:
            counts = (self.cache_queries, self.cache_hits)
            self.cache_queries = self.cache_hits = 0
        return counts

    def check_count(self, count: int) -> None:
        """Raise unless a prompt may hold `count` images (`--limit-mm-per-prompt`).

        Raises:
            ValueError: too many.
        """
        limit = self.config.limit_per_prompt
        if count > limit:
            raise ValueError(f"{count} images in one prompt; at most {limit} allowed "
                             "(--limit-mm-per-prompt '{\"image\": N}')")

    # -- prompts --------------------------------------------------------------------------------

    def render_text(self, text: str, images: list[ProcessedImage], *,
                    add_special_tokens: bool) -> tuple[list[int], list[ImageFeature]]:
        """Token ids of `text` with each image placeholder expanded, and the images' places.

        Raises:
            ValueError: the text's placeholders do not match the images.
        """
        placeholder = self.family.placeholder
        parts = text.split(placeholder)
        if len(parts) - 1 != len(images):
            raise ValueError(f"the prompt holds {len(parts) - 1} image placeholders "
                             f"({placeholder!r}) for {len(images)} images")
        expanded = parts[0] + "".join(image.replacement + part
                                      for image, part in zip(images, parts[1:], strict=True))
        ids = list(self.tokenizer(expanded, add_special_tokens=add_special_tokens).input_ids)
        return ids, self.locate(ids, images)

    def render_tokens(self, ids: list[int],
                      images: list[ProcessedImage]) -> tuple[list[int], list[ImageFeature]]:
        """Token ids with each placeholder token expanded into its image's tokens (a prompt
        given as token ids).

        Raises:
            ValueError: the placeholders do not match the images.
        """
        placeholder = self.tokenizer.convert_tokens_to_ids(self.family.placeholder)
        at = [i for i, t in enumerate(ids) if t == placeholder]
        if len(at) != len(images):
            raise ValueError(f"prompt_token_ids hold {len(at)} image placeholders (token "
                             f"{placeholder}) for {len(images)} images")
        out: list[int] = []
        start = 0
        for i, image in zip(at, images, strict=True):
            out += ids[start:i]
            out += self.tokenizer(image.replacement, add_special_tokens=False).input_ids
            start = i + 1
        out += ids[start:]
        return out, self.locate(out, images)

    def locate(self, ids: list[int], images: list[ProcessedImage]) -> list[ImageFeature]:
        """Each image's positions: the i-th image takes the next `num_embeds` image tokens.

        Raises:
            ValueError: the prompt's image tokens are not the images' count.
        """
        rows = np.flatnonzero(np.asarray(ids, dtype=np.int64) == self.embed_token_id)
        wanted = sum(image.num_embeds for image in images)
        if rows.size != wanted:
            raise ValueError(f"the prompt holds {rows.size} image tokens where its images "
                             f"need {wanted} (an image token written in the text?)")
        features, k = [], 0
        span_cap = self.config.max_span
        for i, image in enumerate(images):
            first, last = int(rows[k]), int(rows[k + image.num_embeds - 1])
            if span_cap and last + 1 - first > span_cap:
                raise ValueError(f"image {i} spans {last + 1 - first} tokens, more than "
                                 f"max_num_batched_tokens ({span_cap}); this model's images "
                                 "are computed in one step")
            features.append(ImageFeature(image.identifier, first, last + 1 - first,
                                         image.num_embeds, image.data))
            k += image.num_embeds
        return features
