"""Token selection: temperature, min-p, top-k / top-p truncation and the random draw.

Random sampling is the exponential race vLLM uses (argmax of probs / q with q ~ Exp(1)): rows
of requests with a seed draw their q from their own generator, so a seeded request gives the
same tokens whatever else is in the batch; other rows share the default generator. Called by
`ringserve.gpu.sampler` after the logits processors.
"""

from __future__ import annotations

import torch

from ringserve.gpu.sampling_metadata import SamplingMetadata


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Sampled ids [n] (int64) from processed float32 logits [n, V]."""
    greedy = None if meta.all_random else logits.argmax(dim=-1)
    if meta.all_greedy:
        assert greedy is not None
        return greedy
    logits = logits / meta.temperature[:, None]
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    drawn = random_sample(logits.softmax(dim=-1), meta.generators)
    return drawn if greedy is None else torch.where(meta.greedy, greedy, drawn)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below `min_p` times the top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the `top_k` largest logits, then the smallest set with mass >= `top_p`.

    `top_k` equal to the vocabulary size and `top_p` of 1.0 leave a row untouched.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p[:, None])
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One draw per row from `probs` [n, V]; seeded rows use their own generator."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div(q).argmax(dim=-1)
