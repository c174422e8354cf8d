"""The verify step's layout: a speculating request's last token and its drafts, one query each.

The scheduler schedules `1 + k` tokens for a request with `k` drafts (`SchedulerOutput.
spec_token_ids`). Here the drafts are written after the request's known tokens in the
runner's table (as scratch: the table's counts are back where they were before the forward
runs, and the sampled tokens overwrite them), and each of the `1 + k` positions becomes a query
of its own, one token long, whose sequence ends at that position. A batch of such queries is a
batch of decodes: it runs through the captured decode step (the C step writes every row's
keys and values before any row attends) or the eager decode path, with the arithmetic of
single-token decoding for every row, so greedy speculation changes no token. Requests without
drafts keep their usual query.

Called by the model runner (`ringserve.gpu.runner.model_runner`) when a step carries drafts;
the draft-model proposer lays out its own catch-up the same way (`expand_queries`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ringserve.gpu.runner.input_prep import StepInputs, build_inputs
from ringserve.gpu.runner.request_state import RequestTable


@dataclass(frozen=True)
class VerifyStep:
    """One step's batch with its drafts laid out for verification.

    Attributes:
        inputs: the flat batch (a draft position is a query of its own).
        req_ids: the step's requests, in batch order (each once).
        slots: int64 [B]: their table slots.
        drafts: per request, the drafts it verifies ([] for none).
        rows: per request, the rows of the hidden states it samples from, in position order:
            `1 + k` for a request with `k` drafts, the last row of its query for a request
            that samples without drafts, none for a prompt chunk before the last.
    """

    inputs: StepInputs
    req_ids: list[str]
    slots: np.ndarray
    drafts: list[list[int]]
    rows: list[np.ndarray]


def prepare_verify(table: RequestTable, req_ids: list[str], num_scheduled: np.ndarray,
                   spec_token_ids: dict[str, list[int]], device: torch.device) -> VerifyStep:
    """Lay out a step whose requests may carry drafts (see the module docstring).

    Raises:
        ValueError: a request's drafts disagree with its schedule (`1 + k` tokens, the
            first of them its last known token), or run past its table.
    """
    slots = np.fromiter((table.slot_of(r) for r in req_ids), dtype=np.int64, count=len(req_ids))
    computed = table.num_computed[slots].astype(np.int64)
    drafts = [spec_token_ids.get(r, []) for r in req_ids]
    k = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(drafts))
    base = table.num_tokens[slots].copy()
    for i in np.flatnonzero(k).tolist():
        _check_drafts(table, req_ids[i], int(slots[i]), int(computed[i]),
                      int(num_scheduled[i]), drafts[i])
    try:
        for i in np.flatnonzero(k).tolist():
            slot, n = int(slots[i]), int(base[i])
            table.token_ids[slot, n:n + len(drafts[i])] = drafts[i]
            table.num_tokens[slot] = n + len(drafts[i])
        queries = np.where(k > 0, 1 + k, 1)
        q_req, q_computed, q_num = expand_queries(computed, num_scheduled.astype(np.int64), k > 0)
        inputs = build_inputs(table, [req_ids[i] for i in q_req.tolist()], slots[q_req],
                              q_computed, q_num, device)
    finally:
        table.num_tokens[slots] = base
    ends = inputs.query_start_loc[1:] - 1  # each query's last row
    first = np.zeros(len(req_ids) + 1, dtype=np.int64)
    np.cumsum(queries, out=first[1:])
    sampling = computed + num_scheduled >= base  # (drafted requests always sample)
    rows = [ends[first[i]:first[i + 1]] if (k[i] or sampling[i]) else ends[:0]
            for i in range(len(req_ids))]
    return VerifyStep(inputs=inputs, req_ids=req_ids, slots=slots, drafts=drafts, rows=rows)


def expand_queries(computed: np.ndarray, num: np.ndarray, split: np.ndarray,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Queries for requests computing `num[i]` tokens from `computed[i]`, the requests
    marked in `split` as `num[i]` one-token queries (a batch of decodes).

    Returns:
        (request index, computed count, tokens) per query.
    """
    per = np.where(split, num, 1)
    q_req = np.repeat(np.arange(len(num)), per)
    first = np.zeros(len(num) + 1, dtype=np.int64)
    np.cumsum(per, out=first[1:])
    offset = np.arange(int(first[-1])) - first[:-1][q_req]
    q_split = split[q_req]
    q_computed = computed[q_req] + np.where(q_split, offset, 0)
    q_num = np.where(q_split, 1, num[q_req])
    return q_req, q_computed, q_num


def _check_drafts(table: RequestTable, req_id: str, slot: int, computed: int, scheduled: int,
                  drafts: list[int]) -> None:
    n = int(table.num_tokens[slot])
    if scheduled != 1 + len(drafts) or computed != n - 1:
        raise ValueError(
            f"request {req_id!r}: {len(drafts)} drafts, but {scheduled} tokens scheduled from "
            f"position {computed} of {n} known (a speculating request computes its last "
            "token and its drafts)")
    if n + len(drafts) > table.max_model_len:
        raise ValueError(f"request {req_id!r}: its drafts run past max_model_len "
                         f"({n} + {len(drafts)} > {table.max_model_len})")
