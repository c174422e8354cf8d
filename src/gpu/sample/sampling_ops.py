"""Token selection: temperature, min-p, top-k / top-p truncation and the random draw.

Random sampling is the exponential race vLLM uses (argmax of probs / q with q ~ Exp(1)): rows
of requests with a seed draw their q over the whole vocabulary from their own generator, so a
seeded request gives the same tokens whatever else is in the batch; other rows share the
default generator. Called by `ringserve.gpu.sample.sampler` after the logits processors.

Over a large vocabulary a full sort per row is the cost to avoid. A row whose top-k is at most
`SMALL_K` is truncated from its `torch.topk` candidates (top-p is computed on the candidates laid
out as the sorted row would be, so the kept set is the one a full sort gives), and an unseeded
such row also draws among its candidates only (the same distribution; no seeded stream is
touched). Only rows with top-p alone or a top-k above `SMALL_K` (and rows whose k-th value
ties past their candidates) are sorted.
"""

from __future__ import annotations

import numpy as np
import torch

from ringserve.gpu.sample.sampling_metadata import SamplingMetadata

SMALL_K = 256  # top-k at or below this truncates from torch.topk candidates, not a full sort


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Sampled ids [n] (int64) from processed float32 logits [n, V]."""
    greedy = None if meta.all_random else logits.argmax(dim=-1)
    if meta.all_greedy:
        assert greedy is not None
        return greedy
    if meta.min_p is None and (meta.top_k is not None or meta.top_p is not None):
        # division is monotone and elementwise: the truncation divides only the rows (or the
        # candidates) it keeps, bit for bit as dividing the whole batch first
        drawn = _sample_truncated(logits, meta, meta.temperature)
    else:
        logits = logits / meta.temperature[:, None]
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is None and meta.top_p is None:
            drawn = random_sample(logits.softmax(dim=-1), meta.generators)
        else:
            drawn = _sample_truncated(logits, meta, None)
    return drawn if greedy is None else torch.where(meta.greedy, greedy, drawn)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below `min_p` times the top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _host_k_p(
    n: int, vocab: int, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> tuple[np.ndarray, np.ndarray]:
    k = np.full(n, vocab, np.int64) if top_k is None else top_k.cpu().numpy()
    p = np.ones(n, np.float32) if top_p is None else top_p.cpu().numpy()
    return k, p


def _select(tensor: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """`tensor[rows]`, without a copy when `rows` is every row in order."""
    if rows.size == tensor.shape[0]:
        return tensor
    return tensor[torch.from_numpy(rows).to(tensor.device)]


def _sample_truncated(
    logits: torch.Tensor, meta: SamplingMetadata, temperature: torch.Tensor | None
) -> torch.Tensor:
    """The draw for a batch with top-k and/or top-p: unseeded small-k rows among their
    candidates, every other random row over its truncated full row. `temperature` [n]: still
    to divide by (None: `logits` are divided already)."""
    n, vocab = logits.shape
    k, _ = _host_k_p(n, vocab, meta.top_k, meta.top_p)
    seeded = np.zeros(n, bool)
    seeded[list(meta.generators)] = True
    random_rows = ~meta.greedy.cpu().numpy()
    drawn = torch.zeros(n, dtype=torch.int64, device=logits.device)
    fast = np.flatnonzero(random_rows & ~seeded & (k <= SMALL_K))
    done = np.zeros(n, bool)
    if fast.size:
        top_p = None if meta.top_p is None else _select(meta.top_p, fast)
        values, ids, complete = truncated_candidates(
            _select(logits, fast), k[fast], top_p,
            None if temperature is None else _select(temperature, fast),
        )
        choice = random_sample(values.softmax(dim=-1), {})
        picked = ids.gather(1, choice.unsqueeze(1)).squeeze(1)
        ok = fast[complete]
        drawn[torch.from_numpy(ok).to(logits.device)] = picked[torch.from_numpy(complete)]
        done[ok] = True
    rest = np.flatnonzero(random_rows & ~done)
    if rest.size:
        index = torch.from_numpy(rest).to(logits.device)
        sub_k = None if meta.top_k is None else meta.top_k[index]
        sub_p = None if meta.top_p is None else meta.top_p[index]
        # edited in place below: a copy (indexing or the division) or `sample`'s own tensor
        sub = _select(logits, rest)
        if temperature is not None:
            sub = sub / _select(temperature, rest)[:, None]
        sub = apply_top_k_top_p(sub, sub_k, sub_p)
        position = {int(r): j for j, r in enumerate(rest.tolist())}
        generators = {position[r]: g for r, g in meta.generators.items() if r in position}
        drawn[index] = random_sample(sub.softmax(dim=-1), generators)
    return drawn


def truncated_candidates(
    logits: torch.Tensor, top_k: np.ndarray, top_p: torch.Tensor | None,
    temperature: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Each row's top-k candidates, those top-k / top-p drops set to -inf.

    Args:
        logits: float32 [m, V].
        top_k: int64 [m] host (V = off), small enough for `torch.topk`.
        top_p: float32 [m] or None.
        temperature: float32 [m] to divide the candidates by, or None (already divided).

    Returns:
        values [m, c] (descending; equal values by ascending id), their ids [m, c], and a
        bool host [m]: the row's kept set lies inside its candidates (False when the k-th
        value's tie group runs past them; such a row needs `apply_top_k_top_p`'s sort).
        Kept values equal those a full sort keeps, down to which of two equal logits a
        top-p cut keeps (the lower id).
    """
    vocab = logits.shape[1]
    width = min(int(top_k.max()) + 1, vocab)
    values, ids = logits.topk(width, dim=-1)
    if temperature is not None:
        values = values / temperature[:, None]
    by_id = ids.argsort(dim=-1)  # then a stable sort by value: equal values by ascending id
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    order = values.argsort(dim=-1, descending=True, stable=True)
    values, ids = values.gather(1, order), ids.gather(1, order)
    kth = values.gather(1, torch.from_numpy(top_k - 1).to(logits.device).unsqueeze(1))
    complete = (values[:, -1:] < kth) | torch.isneginf(kth) | (width == vocab)
    values = values.masked_fill(values < kth, float("-inf"))
    if top_p is not None:
        values = values.masked_fill(_top_p_drop(values, top_p, vocab), float("-inf"))
    return values, ids, complete.squeeze(1).cpu().numpy()


def _top_p_drop(values: torch.Tensor, top_p: torch.Tensor, vocab: int) -> torch.Tensor:
    """The candidates [m, c] (descending) a top-p cut drops.

    The softmax runs over the row a full ascending sort would give after top-k (-inf, then
    the kept values ascending), so its sum, and so each cut, is bit for bit the full sort's;
    the cumulative sum of the leading zeros is exactly zero, so it runs over the tail only.
    """
    width = values.shape[1]
    row = torch.full((values.shape[0], vocab), float("-inf"), device=values.device)
    row[:, vocab - width :] = values.flip(-1)
    cumulative = row.softmax(dim=-1)[:, vocab - width :].cumsum(dim=-1)
    drop = cumulative <= (1 - top_p[:, None])
    drop[:, -1] = False
    return drop.flip(-1)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the `top_k` largest logits, then the smallest set with mass >= `top_p`.

    `top_k` equal to the vocabulary size and `top_p` of 1.0 leave a row untouched. Rows with
    a top-k of at most `SMALL_K` truncate from their candidates; only the others are sorted.
    May edit `logits` in place.
    """
    n, vocab = logits.shape
    k, p = _host_k_p(n, vocab, top_k, top_p)
    work = (k < vocab) | (p < 1.0)
    small = np.flatnonzero(work & (k <= SMALL_K))
    sort_rows = work & (k > SMALL_K)
    if small.size:
        index = torch.from_numpy(small).to(logits.device)
        values, ids, complete = truncated_candidates(
            _select(logits, small), k[small], None if top_p is None else top_p[index]
        )
        sort_rows[small[~complete]] = True
        keep = torch.from_numpy(complete).to(logits.device)
        masked = torch.full((small.size, vocab), float("-inf"), device=logits.device)
        masked.scatter_(1, ids, values)
        if small.size == n and complete.all():
            return masked  # every row truncated from its candidates: no copy back
        logits[index[keep]] = masked[keep]
    if sort_rows.any():
        index = torch.from_numpy(np.flatnonzero(sort_rows)).to(logits.device)
        logits[index] = _sort_top_k_top_p(
            logits[index], None if top_k is None else top_k[index],
            None if top_p is None else top_p[index],
        )
    return logits


def _sort_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """`apply_top_k_top_p` by a full sort of each row (large top-k, or top-p alone)."""
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
