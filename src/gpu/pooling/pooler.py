"""Pooling over a packed batch: the last hidden states of several inputs, back to back, into
one vector each (CLS, MEAN or LAST), then what a request asks of that vector (Matryoshka
truncation, L2 normalisation) or of a classifier's logits (softmax or sigmoid).

The pooling runner (`ringserve.gpu.pooling.encoder_runner`) calls these after the model's
forward; they work on whole tensors, with no Python loop over tokens or inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

__all__ = ["activate", "finish_embedding", "pool"]


def pool(hidden: torch.Tensor, query_start_loc: npt.NDArray[Any],
         pooling_type: str) -> torch.Tensor:
    """One vector per input of a packed batch.

    Args:
        hidden: [T, H] the last hidden states of B inputs back to back.
        query_start_loc: int [B + 1] prefix sums of the inputs' lengths (host).
        pooling_type: "CLS" (each input's first token), "MEAN" (the mean over its tokens) or
            "LAST" (its last token).

    Returns:
        [B, H] float32.

    Raises:
        ValueError: an unknown pooling type, an empty input, or offsets that do not cover
            `hidden`.
    """
    starts = np.asarray(query_start_loc, dtype=np.int64)
    if starts.ndim != 1 or starts.size < 1 or starts[0] != 0 or starts[-1] != hidden.shape[0]:
        raise ValueError(f"query_start_loc must run from 0 to the {hidden.shape[0]} rows of "
                         f"hidden; got {starts.tolist()[:8]}...")
    lengths = np.diff(starts)
    if lengths.size and int(lengths.min()) < 1:
        raise ValueError("every input must have at least one token")
    device = hidden.device
    if pooling_type == "CLS":
        return hidden[torch.from_numpy(starts[:-1]).to(device)].float()
    if pooling_type == "LAST":
        return hidden[torch.from_numpy(starts[1:] - 1).to(device)].float()
    if pooling_type == "MEAN":
        batch = lengths.size
        owner = torch.from_numpy(np.repeat(np.arange(batch, dtype=np.int64), lengths))
        sums = torch.zeros(batch, hidden.shape[1], dtype=torch.float32, device=device)
        sums.index_add_(0, owner.to(device), hidden.float())
        return sums / torch.from_numpy(lengths).to(device=device, dtype=torch.float32)[:, None]
    raise ValueError(f"pooling_type: got {pooling_type!r}, allowed: CLS, MEAN, LAST")


def finish_embedding(vectors: torch.Tensor, normalize: bool,
                     dimensions: int | None) -> torch.Tensor:
    """Embeddings as a request asks for them: the first `dimensions` values (Matryoshka),
    then L2-normalised (`F.normalize` semantics, eps 1e-12) when `normalize`.

    Args:
        vectors: [..., H] embeddings.
        normalize: L2-normalise the (truncated) vectors.
        dimensions: keep the first this many values (None: all).

    Raises:
        ValueError: `dimensions` is not in 1..H.
    """
    if dimensions is not None:
        size = vectors.shape[-1]
        if not 1 <= dimensions <= size:
            raise ValueError(f"dimensions: got {dimensions}, allowed: 1..{size} (the "
                             "embedding size)")
        vectors = vectors[..., :dimensions]
    if normalize:
        vectors = F.normalize(vectors, p=2.0, dim=-1, eps=1e-12)
    return vectors


def activate(logits: torch.Tensor) -> torch.Tensor:
    """A classifier's scores from its logits [..., num_labels]: softmax over the labels when
    there are several, the sigmoid of the one logit otherwise (vLLM's and sentence-
    transformers' CrossEncoder defaults). Computed in float32."""
    logits = logits.float()
    if logits.shape[-1] == 1:
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)
