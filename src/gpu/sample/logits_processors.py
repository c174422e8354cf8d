"""Logit edits before sampling: allowed ids, banned ids, logit bias, then penalties.

Order and formulas follow vLLM V1 (allowed-token mask, bad words and min_tokens stops, logit
bias, then repetition / frequency / presence penalties). Called by `ringserve.gpu.sample.sampler` on
float32 logits; the result feeds both the greedy argmax and random sampling.
"""

from __future__ import annotations

import torch

from ringserve.gpu.sample.sampling_metadata import Penalties, SamplingMetadata, SparseLogitInputs


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Return `logits` [n, V] with every per-request edit of `meta` applied (may be in place)."""
    if meta.sparse is not None:
        logits = apply_sparse(logits, meta.sparse)
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    return logits


def apply_sparse(logits: torch.Tensor, sparse: SparseLogitInputs) -> torch.Tensor:
    """Allowed-token restriction, banned ids (-inf) and logit bias."""
    if sparse.allowed_rows.numel():
        rows = logits[sparse.allowed_rows]
        logits[sparse.allowed_rows] = rows.masked_fill(~sparse.allowed_mask, float("-inf"))
    if sparse.banned_rows.numel():
        logits[sparse.banned_rows, sparse.banned_cols] = float("-inf")
    if sparse.bias_rows.numel():
        logits.index_put_((sparse.bias_rows, sparse.bias_cols), sparse.bias_values, accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt and output, frequency/presence over output.

    Repetition divides positive logits (and multiplies negative ones) of seen tokens by the
    penalty; frequency subtracts penalty * count; presence subtracts penalty once per seen id.
    """
    seen = p.prompt_mask | (p.output_counts > 0)
    rep = torch.where(seen, p.repetition[:, None], torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - p.frequency[:, None] * p.output_counts
    return logits - p.presence[:, None] * (p.output_counts > 0).to(logits.dtype)
