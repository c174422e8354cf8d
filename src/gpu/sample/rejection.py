"""The rejection sampler of speculative decoding: drafts in, the tokens the target emits out.

Every proposer here drafts greedily, so each draft's distribution `q` is one-hot on the draft
token `d`. The standard rule (accept `d` with probability `min(1, p(d) / q(d)) = p(d)`, and
on rejection draw from `max(p - q, 0)` normalised, which is `p` without `d`) then emits each
token with exactly the target's probability `p`, and is the same as: draw a token from `p`
exactly as a step without speculation would; the draft is accepted when the draw equals it.
That is how it runs: position by position, each position's logits go through the ordinary
sampler (`ringserve.gpu.sample.sampler`: penalties, bad words, min_tokens, logit bias, logits
processors, temperature, top-k / top-p / min-p) with the request's history holding the drafts
accepted so far, and the request stops at the first draw that differs from its draft (that
draw is the correction token) or after its last draft (the bonus token).

Two consequences the engine promises: greedy rows emit the target's argmax at every position,
so speculation changes no greedy token; and a seeded request draws from its generator once per
emitted token, as without speculation, so its output is the same with speculation on or off,
whatever number of drafts each step carries. Logprobs are the target's, per emitted token.

A batch whose rows are all plain greedy (no logprobs, penalties or logit edits: nothing that
depends on the history) takes one argmax over every position instead of the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ringserve.gpu.runner.request_state import RequestTable
from ringserve.gpu.sample.sampler import Sampler
from ringserve.gpu.sample.sampling_metadata import SamplingMetadata, build_sampling_metadata
from ringserve.gpu.wire import Logprobs

# Masks a position's logits in place for the requests of its rows (the grammar bitmask):
# (logits, the request index of each row, the draft position).
RowMask = Callable[[torch.Tensor, list[int], int], None]


@dataclass
class DraftSampling:
    """A verify step's result.

    Attributes:
        sampled: per request, the tokens emitted (the accepted drafts, then the correction
            or bonus token); empty for a request that does not sample or failed.
        logprobs: rows aligned with the concatenation of `sampled`, or None when no request
            asked for logprobs.
        errors: request index -> why it failed (NaN logits).
    """

    sampled: list[list[int]]
    logprobs: Logprobs | None
    errors: dict[int, str]


_NAN = "the model produced NaN logits for this request; it cannot be sampled"


def sample_with_drafts(
    logits_at: Callable[[np.ndarray], torch.Tensor],
    rows: list[np.ndarray],
    drafts: list[list[int]],
    slots: np.ndarray,
    table: RequestTable,
    sampler: Sampler,
    vocab_size: int,
    device: torch.device,
    mask: RowMask | None = None,
) -> DraftSampling:
    """Emit each request's tokens from its draft positions (see the module docstring).

    Args:
        logits_at: the target's logits [len(r), V] of the hidden-state rows `r`.
        rows: per request, its hidden-state rows in position order (`1 + k` with `k`
            drafts; empty when it does not sample this step).
        drafts: per request, its drafts.
        slots: per request, its table slot; each emitted token is appended there.
        table: the runner's request table.
        sampler: the sampler.
        vocab_size: the model's vocabulary.
        device: where the sampling inputs go.
        mask: masks the logits of constrained requests at each position (the grammar's
            bitmask row for that draft position).
    """
    n = len(rows)
    sampled: list[list[int]] = [[] for _ in range(n)]
    errors: dict[int, str] = {}
    active = [i for i in range(n) if rows[i].size]
    if not active:
        return DraftSampling(sampled, None, errors)
    meta = build_sampling_metadata(table, slots[active], vocab_size, device)
    plain = (meta.all_greedy and meta.max_num_logprobs is None and meta.sparse is None
             and meta.penalties is None and mask is None)
    if plain:
        _greedy_all(logits_at, rows, drafts, slots, table, active, sampled, errors)
        return DraftSampling(sampled, None, errors)
    return _by_position(logits_at, rows, drafts, slots, table, sampler, vocab_size, device,
                        mask, active, sampled, errors, meta)


def _greedy_all(logits_at: Callable[[np.ndarray], torch.Tensor], rows: list[np.ndarray],
                drafts: list[list[int]], slots: np.ndarray, table: RequestTable,
                active: list[int], sampled: list[list[int]], errors: dict[int, str]) -> None:
    """Plain greedy rows: one argmax over every position, then each request's accepted run."""
    every = np.concatenate([rows[i] for i in active])
    values, ids = logits_at(every).to(torch.float32).max(dim=-1)
    tokens, nan = ids.cpu().numpy().tolist(), torch.isnan(values).cpu().numpy()
    offset = 0
    for i in active:
        count = rows[i].size
        run, draft = tokens[offset:offset + count], drafts[i]
        kept = run[:1]
        for j, token in enumerate(run[1:]):
            if draft[j] != kept[-1]:
                break
            kept.append(token)
        # NaN fails the request only at a position it samples (as the loop would).
        if nan[offset:offset + len(kept)].any():
            errors[i] = _NAN
            offset += count
            continue
        offset += count
        slot = int(slots[i])
        for token in kept:
            table.append_token(slot, token)
        sampled[i] = kept


def _by_position(logits_at: Callable[[np.ndarray], torch.Tensor], rows: list[np.ndarray],
                 drafts: list[list[int]], slots: np.ndarray, table: RequestTable,
                 sampler: Sampler, vocab_size: int, device: torch.device, mask: RowMask | None,
                 active: list[int], sampled: list[list[int]], errors: dict[int, str],
                 first: SamplingMetadata) -> DraftSampling:
    """The general case: position j of every request still running is sampled with the
    history holding its drafts before j (`first`: position 0's metadata, already built)."""
    lp_rows: dict[int, list[tuple[Logprobs, int]]] = {}  # request -> (a position's result, row)
    j = 0
    alive = active
    while alive:
        here = np.fromiter((int(rows[i][j]) for i in alive), dtype=np.int64, count=len(alive))
        logits = logits_at(here)
        if mask is not None:
            mask(logits, alive, j)
        meta = first if j == 0 else build_sampling_metadata(table, slots[alive], vocab_size,
                                                            device)
        result = sampler.forward(logits, meta)
        still: list[int] = []
        for r, i in enumerate(alive):
            if result.nan_rows[r]:
                errors[i] = _NAN
                continue
            token = int(result.token_ids[r])
            table.append_token(int(slots[i]), token)
            sampled[i].append(token)
            if result.logprobs is not None:
                lp_rows.setdefault(i, []).append((result.logprobs, r))
            if j < len(drafts[i]) and token == drafts[i][j]:
                still.append(i)
        alive = still
        j += 1
    for i in errors:
        sampled[i] = []
    return DraftSampling(sampled, _gather(lp_rows, sampled), errors)


def _gather(lp_rows: dict[int, list[tuple[Logprobs, int]]],
            sampled: list[list[int]]) -> Logprobs | None:
    """The logprob rows in the order of the concatenated `sampled` lists (positions whose
    result had fewer columns padded with zeros)."""
    picked = [entry for i in range(len(sampled)) if sampled[i] for entry in lp_rows.get(i, [])]
    if not picked:
        return None
    width = max(lp.token_ids.shape[1] for lp, _ in picked)
    total = sum(len(s) for s in sampled)
    ids = np.zeros((total, width), np.int32)
    values = np.zeros((total, width), np.float32)
    ranks = np.zeros(total, np.int32)
    out = 0
    for i in range(len(sampled)):
        if not sampled[i]:
            continue
        # A request that asked has a row at every position it sampled; one that did not
        # has rows only where another request asked (their content is never read).
        for at, (lp, r) in enumerate(lp_rows.get(i, [])):
            cols = lp.token_ids.shape[1]
            ids[out + at, :cols], values[out + at, :cols] = lp.token_ids[r], lp.logprobs[r]
            ranks[out + at] = lp.ranks[r]
        out += len(sampled[i])
    return Logprobs(token_ids=ids, logprobs=values, ranks=ranks)
