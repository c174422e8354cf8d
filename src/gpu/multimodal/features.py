"""One image of a request as the engine sees it: `ImageFeature`, and its place in the prompt.

The frontend's renderer (`ringserve.engine.frontend.multimodal`) makes one per image: the
processed arrays (pixels, grids) the worker's vision encoder reads, where the image's
placeholder tokens sit in the prompt, how many embedding rows the encoder gives, and a content
identifier. It crosses to the core inside `EngineCoreRequest` and to the workers inside
`NewRequestData` (arrays as out-of-band frames through `ringserve.serial`, never pickled). The
scheduler's encoder books (`ringserve.gpu.multimodal.scheduling`) and the prefix-cache hashes
read only the positions and the identifier.

Torch-free: the frontend and the scheduler import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np


class ImageFeature(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One image of a prompt.

    Attributes:
        identifier: a content hash of the processed image (the decoded pixels and the
            processor's settings): the encoder cache's key and the image's prefix-cache key.
        offset: the prompt position of the image's first placeholder token.
        length: positions from `offset` through the image's last embedding row (Idefics3's
            tiles interleave text tokens between their rows; elsewhere `length ==
            num_embeds`).
        num_embeds: the encoder's output rows, one per position in the range whose token is
            the family's image token.
        data: the processed arrays for the encoder (the image processor's keys, this image's
            slice); dropped by the core once the workers hold them.
    """

    identifier: str
    offset: int
    length: int
    num_embeds: int
    data: dict[str, np.ndarray[Any, Any]] = {}

    @property
    def end(self) -> int:
        """One past the image's last position."""
        return self.offset + self.length

    def without_data(self) -> ImageFeature:
        """The same feature with no arrays (what the core keeps once they were sent)."""
        return ImageFeature(self.identifier, self.offset, self.length, self.num_embeds)


def check_features(features: list[ImageFeature], num_prompt_tokens: int) -> None:
    """Check that the images lie inside the prompt, in order and without overlap.

    Raises:
        ValueError: they do not (a frontend bug or a hand-built request).
    """
    end = 0
    for i, feature in enumerate(features):
        if feature.offset < end or feature.length < feature.num_embeds or feature.num_embeds < 1:
            raise ValueError(f"mm_features[{i}]: positions {feature.offset}..{feature.end} "
                             "overlap the previous image or hold fewer rows than embeddings")
        end = feature.end
    if end > num_prompt_tokens:
        raise ValueError(f"mm_features: an image ends at position {end}, past the prompt's "
                         f"{num_prompt_tokens} tokens")


def block_keys(features: list[ImageFeature]) -> Callable[[int, int], bytes]:
    """The prefix-cache key of a block's images: positions `(start, end)` -> the
    identifiers of the images overlapping them (empty for a text-only block), so the same
    image and text reuse blocks and a different image at the same positions never does."""

    def keys(start: int, end: int) -> bytes:
        parts = [f.identifier.encode() for f in features if f.offset < end and f.end > start]
        return b"\x00".join(parts)

    return keys
