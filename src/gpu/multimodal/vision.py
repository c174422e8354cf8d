"""What the worker needs of a family's vision side: the `VisionEncoder` protocol.

A family (Qwen2-VL / Qwen2.5-VL, Gemma 3, Idefics3 / SmolVLM) implements its vision tower and
projector as one torch module behind this protocol, in its own module of this package. The
model runner's multimodal seam (`ringserve.gpu.multimodal.runner_seam`) builds it from the
checkpoint's config, hands it the checkpoint tensors it owns, and calls `encode` once per image
(the scheduler's encoder budget decides when); the rows it returns replace the image's
placeholder tokens' embeddings in the language model.

Checkpoint names reach `load_weights` with one leading `model.` removed (transformers 5 saves
`model.visual.*`, older checkpoints `visual.*`: both arrive as `visual.*`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import torch


class VisionEncoder(Protocol):
    """A family's vision tower and projector."""

    def owns(self, name: str) -> bool:
        """True for a checkpoint tensor name (leading `model.` removed) that this encoder
        loads."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the tensors `owns` accepted.

        Raises:
            ValueError: a name matches no parameter, or a parameter is missing.
        """
        ...

    def encode(self, data: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings [num_embeds, text_hidden_size] from its processed arrays
        (the keys of the Hugging Face image processor's output, for that image alone)."""
        ...
