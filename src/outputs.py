"""User-facing results: `RequestOutput` and its `CompletionOutput`s.

Built in the frontend (offline `LLM`, `AsyncLLM`) from the engine core's token deltas after
detokenization; never sent across a process boundary, so these are plain dataclasses. The shape
follows vLLM's so that code reading `out.outputs[0].text` keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# One position's log-probabilities: token id -> (logprob, rank, decoded token or None).
PositionLogprobs = dict[int, "Logprob"]


@dataclass(slots=True)
class Logprob:
    """The log-probability of one candidate token at one position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (monotonic seconds) and counts of a request's life, filled by the frontend."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0


@dataclass(slots=True, frozen=True)
class WeightVersionSpan:
    """The weight version a run of a sequence's tokens was generated with.

    Attributes:
        version: the version set by `finish_weight_update` (None: the start-up weights).
        start: the index in the sequence's generated tokens (cumulative, also for DELTA
            outputs) of the first token generated with it.
    """

    version: str | None
    start: int


@dataclass(slots=True)
class CompletionOutput:
    """One of the `n` sequences generated for a request.

    Attributes:
        index: position among the request's `n` outputs.
        text: generated text (cumulative, or only the new part for DELTA output).
        token_ids: generated token ids (same cumulative/delta rule as `text`).
        cumulative_logprob: sum of the sampled tokens' logprobs, when logprobs were asked for.
        logprobs: per generated position, the top candidates, when asked for.
        finish_reason: "stop", "length", "abort", "error" or "repetition"; None while running.
        stop_reason: the stop string or stop token id that ended the sequence, if any.
        weight_versions: the weight versions of its tokens so far, in order (a sequence kept
            across a weight update has two or more); empty before the first token.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)

    @property
    def weight_version(self) -> str | None:
        """The version of the latest tokens (None: the start-up weights, or no token yet)."""
        return self.weight_versions[-1].version if self.weight_versions else None

    def finished(self) -> bool:
        """True once the sequence has a finish reason."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request as seen by the caller.

    Attributes:
        request_id: the caller's (or generated) request id.
        prompt: the prompt text, when the request was given as text.
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: per prompt position (None for the first), when asked for.
        outputs: one `CompletionOutput` per sequence.
        finished: True when every sequence has finished.
        metrics: timing of the request, when stats are collected.
        num_cached_tokens: prompt tokens served from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0


# -- pooling (embeddings, classification, scores: `ringserve.gpu.pooling`) ---------------------


@dataclass(slots=True)
class PoolingOutput:
    """What the pooler computed for one input (vLLM's `PoolingOutput`).

    Attributes:
        data: float32 numpy array: [hidden] (or [dimensions]) for an embedding, [num_labels]
            for a classification or score, [num_tokens, hidden] for per-token outputs. (vLLM
            holds a torch tensor here; ringserve's frontend imports no torch.)
    """

    data: Any


@dataclass(slots=True)
class PoolingRequestOutput:
    """One pooling request's result (vLLM's `PoolingRequestOutput`).

    Attributes:
        request_id: the caller's (or generated) request id.
        outputs: the pooled result.
        prompt_token_ids: the input's token ids (after truncation).
        finished: always True (a pooling request answers once).
        num_cached_tokens: prompt tokens served from the prefix cache.
    """

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass(slots=True)
class EmbeddingOutput:
    """An embedding (`LLM.embed`): `embedding` as a list of floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """The embedding's length."""
        return len(self.embedding)


@dataclass(slots=True)
class ClassificationOutput:
    """A classification (`LLM.classify`): one probability (or activated logit) per label."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        """The number of labels."""
        return len(self.probs)


@dataclass(slots=True)
class ScoringOutput:
    """A relevance score (`LLM.score`): a cross-encoder's activated logit, or the cosine of
    two embeddings."""

    score: float


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one input (vLLM's shape: `.outputs.embedding`)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class ClassificationRequestOutput:
    """`LLM.classify`'s result for one input (`.outputs.probs`)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class ScoringRequestOutput:
    """`LLM.score`'s result for one pair (`.outputs.score`)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
