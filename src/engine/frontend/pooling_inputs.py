"""Pooling inputs on the frontend: from texts or token ids to the engine requests that pool
them, and from those requests' outputs back to one answer per input.

Shared by the HTTP pooling routes (`ringserve.http.pooling`) and the offline `LLM`'s `embed` /
`classify` / `score` / `encode`; it imports no trio and no torch. The steps:

- tokenization (`tokenize_texts`, `tokenize_pairs`): one batch call of the model's
  transformers tokenizer, which is the measured cost for short inputs; special tokens are
  added as the tokenizer adds them by default (what sentence-transformers' `encode` and
  `CrossEncoder.predict` feed the model). transformers turns off the truncation and padding a
  `tokenizer.json` may store whenever a call does not ask for them, so they are ignored.
  Truncation (`truncate_prompt_tokens`, resolved by `truncation_length`) is the tokenizer's
  (`truncation=True, max_length=k`: the end special token kept, as sentence-transformers
  truncates); token-id inputs keep their first k ids.
- checks (`check_token_ids`, `check_dimensions`): empty inputs, ids outside the vocabulary,
  Matryoshka `dimensions`; each a ValueError whose message starts with the request field.
- planning (`plan_inputs`): each input becomes one engine request, or, when it is longer than
  the model takes and `--pooler-config` has `enable_chunked_processing` (embed with MEAN
  pooling), one request per chunk of `max_input_len` tokens, each from position 0 and without
  special tokens added again (vLLM's rule); `InputPlan.combine` pools the chunks' embeddings
  into their token-weighted mean, then truncates to `dimensions` and normalises, as the
  pooler would have done for the whole input.
- `cosine_similarity`: the score of two embeddings (`/score` on an embedding model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from ringserve.config import PoolerConfig
from ringserve.pooling_params import PoolingParams

__all__ = [
    "InputPlan",
    "PoolingJob",
    "TokenizedInput",
    "check_dimensions",
    "check_token_ids",
    "cosine_similarity",
    "plan_inputs",
    "tokenize_pairs",
    "tokenize_texts",
    "truncate_token_ids",
    "truncation_length",
]

FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class TokenizedInput:
    """One input as token ids.

    Attributes:
        token_ids: the ids the model reads (special tokens included).
        token_type_start: for a text pair, the index of its second segment's first token
            (BERT token types); None otherwise.
    """

    token_ids: list[int]
    token_type_start: int | None = None


@dataclass(frozen=True, slots=True)
class PoolingJob:
    """One engine request of an input (the whole input, or one chunk of it)."""

    prompt_token_ids: list[int]
    params: PoolingParams


@dataclass(frozen=True, slots=True)
class InputPlan:
    """How one input is pooled: its engine requests and how their outputs combine.

    Attributes:
        jobs: one request, or one per chunk (`chunked`).
        num_tokens: the input's length in tokens (after truncation; the usage's count).
        chunked: the jobs are chunks whose raw embeddings `combine` pools.
        normalize: a chunked input's embedding is L2-normalised after combining.
        dimensions: a chunked input's embedding keeps its first `dimensions` values.
    """

    jobs: tuple[PoolingJob, ...]
    num_tokens: int
    chunked: bool = False
    normalize: bool = False
    dimensions: int | None = None

    def combine(self, outputs: Sequence[FloatArray]) -> FloatArray:
        """The input's answer from its jobs' outputs (in job order).

        A chunked input's embedding is the token-weighted mean of its chunks' mean-pooled
        embeddings (the mean over all its tokens), truncated to `dimensions` and normalised
        when asked; a single job's output is the answer as it is.
        """
        if len(outputs) != len(self.jobs):
            raise ValueError(f"expected {len(self.jobs)} outputs, got {len(outputs)}")
        if not self.chunked:
            return outputs[0]
        weights = np.array([len(job.prompt_token_ids) for job in self.jobs], dtype=np.float64)
        stacked = np.stack([np.asarray(out, dtype=np.float64) for out in outputs])
        mean = (weights[:, None] * stacked).sum(axis=0) / weights.sum()
        if self.dimensions is not None:
            mean = mean[: self.dimensions]
        if self.normalize:
            mean = mean / max(float(np.linalg.norm(mean)), 1e-12)
        combined: FloatArray = np.asarray(mean, dtype=np.float32)
        return combined


def truncation_length(truncate_prompt_tokens: int | None, pooler: PoolerConfig) -> int | None:
    """The length inputs are truncated to: None (no truncation), the model's longest input
    (`max_input_len`) for -1, else the value itself, which may reach `max_embed_len` (or
    anything, without one) when chunked processing is on.

    Raises:
        ValueError: a value other than -1 or 1 to the longest input the server takes (naming
            truncate_prompt_tokens).
    """
    if truncate_prompt_tokens is None:
        return None
    model_len = pooler.max_input_len
    if truncate_prompt_tokens == -1:
        return model_len
    longest: int | None = model_len if model_len > 0 else None
    if pooler.enable_chunked_processing:
        longest = pooler.max_embed_len
    if truncate_prompt_tokens < 1 or (longest is not None and truncate_prompt_tokens > longest):
        allowed = f"1 to {longest}" if longest is not None else "1 or more"
        raise ValueError(f"truncate_prompt_tokens: got {truncate_prompt_tokens}, allowed: -1 "
                         f"(the model's length, {model_len}) or {allowed}")
    return truncate_prompt_tokens


def tokenize_texts(tokenizer: Any, texts: Sequence[str], truncate_to: int | None = None,
                   *, add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each text, in one batch call (special tokens added as the tokenizer
    does by default unless `add_special_tokens` is False; truncated by the tokenizer to
    `truncate_to` tokens when given)."""
    if not texts:
        return []
    kwargs: dict[str, Any] = {"return_attention_mask": False, "return_token_type_ids": False,
                              "add_special_tokens": add_special_tokens}
    if truncate_to is not None:
        kwargs.update(truncation=True, max_length=truncate_to)
    return [list(ids) for ids in tokenizer(list(texts), **kwargs)["input_ids"]]


def tokenize_pairs(tokenizer: Any, firsts: Sequence[str], seconds: Sequence[str],
                   truncate_to: int | None = None) -> list[TokenizedInput]:
    """Each pair `(firsts[i], seconds[i])` tokenized as the tokenizer joins a text pair
    (BERT: `[CLS] a [SEP] b [SEP]`), in one batch call; `token_type_start` is the first
    index whose token type is 1 (None when the tokenizer gives no token types or none is 1).

    Raises:
        ValueError: the lists differ in length.
    """
    if len(firsts) != len(seconds):
        raise ValueError(f"text pairs: {len(firsts)} first texts against {len(seconds)} "
                         "second texts")
    if not firsts:
        return []
    kwargs: dict[str, Any] = {"return_attention_mask": False}
    if truncate_to is not None:
        kwargs.update(truncation=True, max_length=truncate_to)
    encoded = tokenizer(list(firsts), list(seconds), **kwargs)
    types = encoded.get("token_type_ids")
    pairs = []
    for i, ids in enumerate(encoded["input_ids"]):
        start = None
        if types is not None:
            start = next((j for j, t in enumerate(types[i]) if t == 1), None)
        pairs.append(TokenizedInput(list(ids), start))
    return pairs


def truncate_token_ids(inputs: Sequence[list[int]], truncate_to: int | None) -> list[list[int]]:
    """Token-id inputs truncated to their first `truncate_to` ids (None: as they are)."""
    if truncate_to is None:
        return list(inputs)
    return [ids[:truncate_to] for ids in inputs]


def check_token_ids(inputs: Sequence[Sequence[int]], vocab_size: int, field: str,
                    noun: str = "input") -> None:
    """Refuse empty inputs and ids outside the vocabulary.

    Args:
        field: the request field the inputs came from (the message starts with it).
        noun: what one input is called in the message ("input", "document", "pair").

    Raises:
        ValueError: an input has no tokens, or an id outside [0, vocab_size).
    """
    if not inputs:
        raise ValueError(f"{field}: got an empty list; allowed: at least one {noun}")
    for i, ids in enumerate(inputs):
        if not ids:
            raise ValueError(f"{field}: {noun} {i} is empty (no tokens); this model cannot "
                             "pool an empty input")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{field}: {noun} {i} has token ids {bad[:5]} outside the "
                             f"vocabulary [0, {vocab_size})")


def check_dimensions(dimensions: int | None, pooler: PoolerConfig, hidden_size: int) -> None:
    """Refuse a `dimensions` the model cannot give: any on a model that is not Matryoshka,
    one outside the model's listed sizes, or one above its hidden size.

    Raises:
        ValueError: naming `dimensions` and what is allowed.
    """
    if dimensions is None:
        return
    allowed = pooler.matryoshka_dimensions
    if allowed is None:
        raise ValueError(f"dimensions: this model is not a Matryoshka model, so its "
                         f"embeddings cannot be shortened (got {dimensions}; leave dimensions "
                         f"out for the full {hidden_size})")
    if dimensions < 1 or dimensions > hidden_size:
        raise ValueError(f"dimensions: got {dimensions}, allowed: 1 to the hidden size "
                         f"{hidden_size}")
    if allowed and dimensions not in allowed:
        raise ValueError(f"dimensions: got {dimensions}, allowed: "
                         f"{', '.join(str(d) for d in allowed)}")


def _chunkable(params: PoolingParams, pooler: PoolerConfig) -> bool:
    return params.task == "embed" and pooler.pooling_type == "MEAN"


def _too_long(field: str, noun: str, index: int, length: int, pooler: PoolerConfig,
              chunkable: bool) -> ValueError:
    hint = "set truncate_prompt_tokens"
    if chunkable:
        hint += ", or --pooler-config enable_chunked_processing"
    return ValueError(f"{field}: {noun} {index} has {length} tokens; this model takes at most "
                      f"{pooler.max_input_len} ({hint})")


def plan_inputs(inputs: Sequence[TokenizedInput | list[int]], params: PoolingParams,
                pooler: PoolerConfig, *, field: str, noun: str = "input") -> list[InputPlan]:
    """The engine requests of each input (in input order).

    An input within the model's length is one request with `params` (and the input's own
    `token_type_start`). A longer one is refused, unless chunked processing is on and
    applies (embed, MEAN pooling): then it is cut into chunks of `max_input_len` tokens,
    each requested raw (not normalised, full width) and combined by `InputPlan.combine`.

    Args:
        inputs: token ids (already truncated), or tokenized pairs.
        params: the request's pooling parameters.
        pooler: the engine's pooler (`EngineConfig.pooler_config`).
        field, noun: how the messages name the inputs ("input", "input 3").

    Raises:
        ValueError: an input is longer than the model takes (or than `max_embed_len` when
            chunking), naming the field, the input and the length allowed.
    """
    limit = pooler.max_input_len
    chunkable = pooler.enable_chunked_processing and _chunkable(params, pooler)
    plans = []
    for i, item in enumerate(inputs):
        tokenized = item if isinstance(item, TokenizedInput) else TokenizedInput(item)
        ids = tokenized.token_ids
        length = len(ids)
        if limit <= 0 or length <= limit:
            job_params = params
            if tokenized.token_type_start is not None:
                job_params = msgspec.structs.replace(
                    params, token_type_start=tokenized.token_type_start)
            plans.append(InputPlan((PoolingJob(ids, job_params),), length))
            continue
        if not chunkable:
            raise _too_long(field, noun, i, length, pooler,
                            _chunkable(params, pooler) and not pooler.enable_chunked_processing)
        if pooler.max_embed_len is not None and length > pooler.max_embed_len:
            raise ValueError(f"{field}: {noun} {i} has {length} tokens; this server embeds "
                             f"at most max_embed_len={pooler.max_embed_len} tokens (set "
                             "truncate_prompt_tokens)")
        raw = msgspec.structs.replace(params, normalize=False, dimensions=None)
        jobs = tuple(PoolingJob(ids[start:start + limit], raw)
                     for start in range(0, length, limit))
        normalize = pooler.normalize if params.normalize is None else params.normalize
        plans.append(InputPlan(jobs, length, chunked=True, normalize=normalize,
                               dimensions=params.dimensions))
    return plans


def cosine_similarity(a: FloatArray, b: FloatArray) -> float:
    """The cosine of two embeddings (0 when either is all zeros)."""
    a64 = np.asarray(a, dtype=np.float64).ravel()
    b64 = np.asarray(b, dtype=np.float64).ravel()
    denom = float(np.linalg.norm(a64) * np.linalg.norm(b64))
    if denom == 0.0:
        return 0.0
    return float(np.dot(a64, b64) / denom)
