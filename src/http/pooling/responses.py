"""Response bodies of the pooling routes, encoded with msgspec (OpenAI's embeddings shape,
vLLM's `/pooling`, `/classify` and `/score`, Jina's and Cohere's `/rerank`).

Vectors leave as JSON arrays built from `ndarray.tolist()` (msgspec writes the floats in C),
or, with `encoding_format: "base64"`, as the base64 of their little-endian float32 bytes
(OpenAI's format; a per-token output is flattened row after row).
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import msgspec
import numpy as np

from ringserve.engine.frontend.pooling_inputs import FloatArray


def response_id(prefix: str, given: str | None = None) -> str:
    """A response's id: `<prefix>-` and the request's id, or fresh hex (vLLM's)."""
    return f"{prefix}-{given or uuid.uuid4().hex}"


def now() -> int:
    """A response's `created` (seconds since the epoch)."""
    return int(time.time())


def encode_vector(data: FloatArray, encoding_format: str) -> list[Any] | str:
    """A vector (or a per-token matrix) as JSON floats or base64 of little-endian float32."""
    if encoding_format == "base64":
        raw = np.ascontiguousarray(data, dtype="<f4").tobytes()
        return base64.b64encode(raw).decode("ascii")
    values: list[Any] = np.asarray(data, dtype=np.float32).tolist()
    return values


class PoolingUsage(msgspec.Struct, kw_only=True):
    """Token counts (prompts only: pooling generates nothing)."""

    prompt_tokens: int
    total_tokens: int


def usage_of(prompt_tokens: int) -> PoolingUsage:
    """A usage whose total is its prompt tokens."""
    return PoolingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)


class EmbeddingData(msgspec.Struct, kw_only=True):
    """One embedding of `/v1/embeddings`."""

    index: int
    embedding: list[Any] | str
    object: str = "embedding"


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    """`/v1/embeddings`'s answer."""

    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage
    object: str = "list"


class PoolingData(msgspec.Struct, kw_only=True):
    """One output of `/pooling`: a vector, or a list of per-token vectors."""

    index: int
    data: list[Any] | str
    object: str = "pooling"


class PoolingResponse(msgspec.Struct, kw_only=True):
    """`/pooling`'s answer."""

    id: str
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
    object: str = "list"


class ClassificationData(msgspec.Struct, kw_only=True):
    """One classification: the top label, every label's probability, the label count."""

    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(msgspec.Struct, kw_only=True):
    """`/classify`'s answer."""

    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage
    object: str = "list"


class ScoreData(msgspec.Struct, kw_only=True):
    """One pair's score."""

    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct, kw_only=True):
    """`/score`'s answer."""

    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
    object: str = "list"


class RerankDocument(msgspec.Struct, kw_only=True):
    """A reranked document's text."""

    text: str


class RerankResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One document's rank (`document` left out when `return_documents` is false)."""

    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct, kw_only=True):
    """`/rerank`'s usage (Jina's and Cohere's: a total only)."""

    total_tokens: int


class RerankResponse(msgspec.Struct, kw_only=True):
    """`/rerank`'s answer, results by decreasing relevance."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
