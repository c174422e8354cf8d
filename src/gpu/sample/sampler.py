"""The sampler: one batched pass from logits to sampled ids (and their logprobs).

Pipeline, as in vLLM V1: float32 logits -> NaN check (a row with a NaN fails its request
alone) -> raw logprobs when any row wants them -> allowed ids / banned ids / logit bias /
penalties (`ringserve.gpu.sample.logits_processors`) -> greedy argmax, and, unless the whole batch is
greedy, temperature, min-p, top-k/top-p and the seeded random draw
(`ringserve.gpu.sample.sampling_ops`). A greedy batch with no logprobs and no logit edits (the common
offline case) takes one `max` pass instead: NaN check and argmax together. Raw logprobs are
computed on the rows that asked for them only. The model runner calls `Sampler.forward` once
per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ringserve.gpu.runner.request_state import NO_LOGPROBS
from ringserve.gpu.sample.logits_processors import apply_logits_processors
from ringserve.gpu.sample.logprobs import gather_logprobs
from ringserve.gpu.sample.sampling_metadata import SamplingMetadata
from ringserve.gpu.sample.sampling_ops import sample
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
        # amax propagates NaN: one reduction, no [n, V] mask
        nan = torch.isnan(logits.amax(dim=-1))
        nan_rows = nan.cpu().numpy()
        if nan_rows.any():
            logits = logits.masked_fill(nan.unsqueeze(1), 0.0)
        wanted = np.flatnonzero(meta.num_logprobs != NO_LOGPROBS)
        raw = None
        if meta.max_num_logprobs is not None:
            raw = (logits if wanted.size == len(logits)
                   else logits[torch.from_numpy(wanted).to(logits.device)]).log_softmax(dim=-1)
        logits = apply_logits_processors(logits, meta)
        token_ids = sample(logits, meta)
        logprobs = None
        if raw is not None and meta.max_num_logprobs is not None:
            logprobs = _row_logprobs(raw, token_ids, wanted, meta.max_num_logprobs)
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


def _row_logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, wanted: np.ndarray, k: int
) -> Logprobs:
    """Logprobs for every row from `raw`, the log-softmax of the `wanted` rows only.

    Rows that did not ask hold their sampled id, logprob 0 and rank 0 (the engine reads a
    request's rows only when it asked for logprobs).
    """
    n = token_ids.shape[0]
    if wanted.size == n:
        return gather_logprobs(raw, token_ids, k)
    asked = gather_logprobs(raw, token_ids[torch.from_numpy(wanted).to(token_ids.device)], k)
    ids = np.zeros((n, k + 1), np.int32)
    ids[:, 0] = token_ids.cpu().numpy()
    values = np.zeros((n, k + 1), np.float32)
    ranks = np.zeros(n, np.int32)
    ids[wanted], values[wanted], ranks[wanted] = asked.token_ids, asked.logprobs, asked.ranks
    return Logprobs(token_ids=ids, logprobs=values, ranks=ranks)
