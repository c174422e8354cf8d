"""The sampler: one batched pass from logits to sampled ids (and their logprobs).

Pipeline, as in vLLM V1: float32 logits -> NaN check (a row with a NaN fails its request
alone) -> raw logprobs when any row wants them -> allowed ids / banned ids / logit bias /
penalties (`ringserve.gpu.logits_processors`) -> greedy argmax, and, unless the whole batch is
greedy, temperature, min-p, top-k/top-p and the seeded random draw
(`ringserve.gpu.sampling_ops`). A greedy batch with no logprobs and no logit edits (the common
offline case) takes one `max` pass instead: NaN check and argmax together. The model runner
calls `Sampler.forward` once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ringserve.gpu.logits_processors import apply_logits_processors
from ringserve.gpu.logprobs import gather_logprobs
from ringserve.gpu.sampling_metadata import SamplingMetadata
from ringserve.gpu.sampling_ops import sample
from ringserve.gpu.wire import Logprobs


@dataclass(frozen=True)
class SamplerOutput:
    """One step's sampling result.

    Attributes:
        token_ids: int64 host array [n]: the sampled id per row.
        logprobs: rows aligned with `token_ids`, or None when no row asked.
        nan_rows: bool host array [n]: rows whose logits held a NaN (their ids are
            meaningless; the runner fails those requests).
    """

    token_ids: np.ndarray
    logprobs: Logprobs | None
    nan_rows: np.ndarray


class Sampler:
    """Stateless batched sampler (per-request state lives in `SamplingMetadata`)."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` [n, V]."""
        logits = logits.to(torch.float32)
        plain = meta.max_num_logprobs is None and meta.sparse is None and meta.penalties is None
        if meta.all_greedy and plain:
            return _plain_greedy(logits)
        nan = torch.isnan(logits).any(dim=-1)
        nan_rows = nan.cpu().numpy()
        if nan_rows.any():
            logits = logits.masked_fill(nan.unsqueeze(1), 0.0)
        raw = None if meta.max_num_logprobs is None else logits.log_softmax(dim=-1)
        logits = apply_logits_processors(logits, meta)
        token_ids = sample(logits, meta)
        logprobs = None
        if raw is not None and meta.max_num_logprobs is not None:
            logprobs = gather_logprobs(raw, token_ids, meta.max_num_logprobs)
        return SamplerOutput(
            token_ids=token_ids.cpu().numpy(), logprobs=logprobs, nan_rows=nan_rows
        )


def _plain_greedy(logits: torch.Tensor) -> SamplerOutput:
    """Greedy rows with nothing to edit and no logprobs: one pass over the logits.

    `max` propagates NaN, so a row holding one has a NaN maximum; its id is meaningless, as
    on the general path. Ties go to the first index, as with `argmax`.
    """
    values, token_ids = logits.max(dim=-1)
    return SamplerOutput(
        token_ids=token_ids.cpu().numpy(), logprobs=None,
        nan_rows=torch.isnan(values).cpu().numpy(),
    )
