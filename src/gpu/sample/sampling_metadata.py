"""Sampling metadata: one step's per-row sampling inputs as device tensors.

Built by the model runner from the request table for the rows that sample this step. Scalar
parameters (temperature, top-k/p, min-p, penalties, logprob counts) are gathered from the
table's slot arrays in one vectorised step; the sparse, per-request inputs (min_tokens stop
masks, bad words, logit bias, allowed ids) loop only over the rows that use them. The sampler
(`ringserve.gpu.sample.sampler`) consumes the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ringserve.gpu.runner.request_state import NO_LOGPROBS, RequestState, RequestTable

_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class Penalties:
    """Repetition (prompt + output), frequency and presence (output) penalty inputs.

    Attributes:
        presence, frequency, repetition: float32 [n].
        prompt_mask: bool [n, V]: the token occurs in the prompt.
        output_counts: float32 [n, V]: occurrences in the output so far.
    """

    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    prompt_mask: torch.Tensor
    output_counts: torch.Tensor


@dataclass(frozen=True)
class SparseLogitInputs:
    """Per-request logit edits, flattened to (row, column) index pairs.

    Attributes:
        banned_rows, banned_cols: int64: logits set to -inf (min_tokens stops, bad words).
        bias_rows, bias_cols, bias_values: logit_bias additions.
        allowed_rows: int64: rows restricted to `allowed_mask`'s columns.
        allowed_mask: bool [len(allowed_rows), V]: the allowed ids of those rows.
    """

    banned_rows: torch.Tensor
    banned_cols: torch.Tensor
    bias_rows: torch.Tensor
    bias_cols: torch.Tensor
    bias_values: torch.Tensor
    allowed_rows: torch.Tensor
    allowed_mask: torch.Tensor


@dataclass(frozen=True)
class SamplingMetadata:
    """Everything the sampler needs for `n` rows.

    Attributes:
        temperature: float32 [n] (1.0 on greedy rows).
        greedy: bool [n].
        all_greedy: every row is greedy (argmax fast path).
        all_random: no row is greedy.
        top_k: int64 [n] (vocab size = off) or None when no row uses it.
        top_p: float32 [n] or None.
        min_p: float32 [n] or None.
        generators: row -> the request's seeded generator.
        num_logprobs: int32 [n] host: logprobs per row (NO_LOGPROBS: none; vocab for -1).
        max_num_logprobs: the largest, or None when no row wants logprobs.
        penalties: or None when no row uses penalties.
        sparse: or None when no row has sparse logit edits this step.
    """

    temperature: torch.Tensor
    greedy: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    num_logprobs: np.ndarray
    max_num_logprobs: int | None
    penalties: Penalties | None
    sparse: SparseLogitInputs | None


def build_sampling_metadata(
    table: RequestTable, slots: np.ndarray, vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """Gather the sampling inputs of the requests in `slots` (one row each)."""
    temp = table.temperature[slots]
    greedy = temp < _GREEDY_EPS
    top_k = np.where(table.top_k[slots] > 0, table.top_k[slots], vocab_size).astype(np.int64)
    top_p = table.top_p[slots]
    min_p = table.min_p[slots]
    num_lp = table.num_logprobs[slots].copy()
    num_lp[num_lp == -1] = vocab_size
    wanted = num_lp[num_lp != NO_LOGPROBS]
    states = [table.req_at_slot[int(s)] for s in slots]
    generators = {
        i: st.generator for i, st in enumerate(states) if st is not None and st.generator is not None
    }
    return SamplingMetadata(
        temperature=_dev(np.where(greedy, 1.0, temp).astype(np.float32), device),
        greedy=_dev(greedy, device),
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
        top_k=_dev(top_k, device) if (top_k < vocab_size).any() else None,
        top_p=_dev(top_p, device) if (top_p < 1.0).any() else None,
        min_p=_dev(min_p, device) if (min_p > 0.0).any() else None,
        generators=generators,
        num_logprobs=num_lp,
        max_num_logprobs=int(wanted.max()) if wanted.size else None,
        penalties=_penalties(table, slots, vocab_size, device),
        sparse=_sparse_inputs(table, slots, states, vocab_size, device),
    )


def _penalties(
    table: RequestTable, slots: np.ndarray, vocab_size: int, device: torch.device
) -> Penalties | None:
    presence, frequency = table.presence[slots], table.frequency[slots]
    repetition = table.repetition[slots]
    if not ((presence != 0).any() or (frequency != 0).any() or (repetition != 1).any()):
        return None
    n_tok = table.num_tokens[slots].astype(np.int64)
    n_prompt = table.num_prompt_tokens[slots].astype(np.int64)
    pos = np.arange(int(n_tok.max()))
    tokens = table.token_ids[slots, : pos.size].astype(np.int64)
    in_prompt = pos[None, :] < n_prompt[:, None]
    in_output = ~in_prompt & (pos[None, :] < n_tok[:, None])
    prompt_ids = _dev(np.where(in_prompt, tokens, vocab_size), device)
    output_ids = _dev(np.where(in_output, tokens, vocab_size), device)
    n = len(slots)
    prompt_mask = torch.zeros(n, vocab_size + 1, dtype=torch.bool, device=device)
    prompt_mask.scatter_(1, prompt_ids, True)
    counts = torch.zeros(n, vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=torch.float32))
    return Penalties(
        presence=_dev(presence, device),
        frequency=_dev(frequency, device),
        repetition=_dev(repetition, device),
        prompt_mask=prompt_mask[:, :vocab_size],
        output_counts=counts[:, :vocab_size],
    )


def _sparse_inputs(
    table: RequestTable,
    slots: np.ndarray,
    states: list[RequestState | None],
    vocab_size: int,
    device: torch.device,
) -> SparseLogitInputs | None:
    num_output = table.num_tokens[slots] - table.num_prompt_tokens[slots]
    under_min = num_output < table.min_tokens[slots]
    rows = np.flatnonzero(under_min | table.has_sparse[slots])
    if rows.size == 0:
        return None
    banned: tuple[list[int], list[int]] = ([], [])
    bias: tuple[list[int], list[int], list[float]] = ([], [], [])
    allowed: list[tuple[int, list[int]]] = []
    for row in rows.tolist():
        state = states[row]
        assert state is not None
        if under_min[row]:
            banned[0].extend([row] * len(state.stop_token_ids))
            banned[1].extend(state.stop_token_ids)
        slot = int(slots[row])
        output = table.token_ids[slot, table.num_prompt_tokens[slot] : table.num_tokens[slot]]
        for word in state.bad_words_ids:
            prefix = word[:-1]
            if len(output) >= len(prefix) and (not prefix or output[-len(prefix) :].tolist() == prefix):
                banned[0].append(row)
                banned[1].append(word[-1])
        for token, value in (state.params.logit_bias or {}).items():
            bias[0].append(row)
            bias[1].append(int(token))
            bias[2].append(float(value))
        if state.params.allowed_token_ids:
            allowed.append((row, state.params.allowed_token_ids))
    mask = torch.zeros(len(allowed), vocab_size, dtype=torch.bool, device=device)
    for i, (_, ids) in enumerate(allowed):
        mask[i, torch.tensor(ids, device=device)] = True
    return SparseLogitInputs(
        banned_rows=torch.tensor(banned[0], dtype=torch.int64, device=device),
        banned_cols=torch.tensor(banned[1], dtype=torch.int64, device=device),
        bias_rows=torch.tensor(bias[0], dtype=torch.int64, device=device),
        bias_cols=torch.tensor(bias[1], dtype=torch.int64, device=device),
        bias_values=torch.tensor(bias[2], dtype=torch.float32, device=device),
        allowed_rows=torch.tensor([r for r, _ in allowed], dtype=torch.int64, device=device),
        allowed_mask=mask,
    )


def _dev(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)
