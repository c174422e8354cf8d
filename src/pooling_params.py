"""Pooling parameters: what a pooling request (an embedding, a classification, a score) asks of
the pooler after the model's last hidden states.

`PoolingParams` is to a pooling request what `SamplingParams` is to a generation request
(vLLM's `PoolingParams`): built by the HTTP layer or `LLM.embed` / `classify` / `score` /
`encode`, it travels inside `EngineCoreRequest` to the workers, whose pooler
(`ringserve.gpu.pooling`) applies it. Validation runs on construction and again whenever the
struct is decoded from the wire.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["POOLING_TASKS", "PoolingParams", "PoolingTask"]

# embed: one vector per input (the model's pooling, then normalisation and Matryoshka
# truncation); classify: the classifier head's logits through its activation, one row;
# score: a cross-encoder's relevance (classify of a pair, the sigmoid of a single logit);
# token_embed: the last hidden state of every token; token_classify: the classifier head over
# every token.
PoolingTask = Literal["embed", "classify", "score", "token_embed", "token_classify"]
POOLING_TASKS: tuple[str, ...] = ("embed", "classify", "score", "token_embed", "token_classify")


def _fail(field: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"PoolingParams.{field}: got {value!r}, allowed: {allowed}")


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """How to pool one request (vLLM's field names).

    Attributes:
        task: what to compute (see `PoolingTask`).
        normalize: L2-normalise the embedding; None: the model's default (a sentence-
            transformers `Normalize` module, or `--pooler-config`'s `normalize`).
        dimensions: keep the first `dimensions` values of the embedding (Matryoshka models),
            normalised again afterwards when normalisation is on.
        activation: apply the classifier's activation (softmax over several labels, sigmoid
            over one); None: on.
        token_type_start: for a text pair on a model with token types (BERT cross-encoders),
            the index of the pair's second segment's first token; its tokens get token type
            1. None: every token is type 0.
    """

    task: PoolingTask = "embed"
    normalize: bool | None = None
    dimensions: int | None = None
    activation: bool | None = None
    token_type_start: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise _fail("task", self.task, ", ".join(POOLING_TASKS))
        if self.dimensions is not None and self.dimensions < 1:
            raise _fail("dimensions", self.dimensions, ">= 1")
        if self.token_type_start is not None and self.token_type_start < 0:
            raise _fail("token_type_start", self.token_type_start, ">= 0")
