"""Prompt logprobs: for each prompt position computed this step, the logprob of the next
prompt token (plus the top-k of that position).

Called by the model runner with the step's final hidden states. Row `j` of a request's result
is prompt position `p` = its j-th computed position with `p + 1 < prompt length`, and column 0
holds prompt token `p + 1`; the first prompt token has no logprob (the frontend shows None for
it), so over all chunks a request gets `prompt_len - 1` rows. Loops over requests that asked
for prompt logprobs only.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ringserve.gpu.runner.input_prep import StepInputs
from ringserve.gpu.runner.request_state import NO_LOGPROBS, RequestTable
from ringserve.gpu.sample.logprobs import gather_logprobs
from ringserve.gpu.wire import Logprobs


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    inputs: StepInputs,
    table: RequestTable,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> dict[str, Logprobs]:
    """Prompt logprobs of this step's prompt positions, per request that asked for them."""
    wanted = table.num_prompt_logprobs[inputs.slots]
    out: dict[str, Logprobs] = {}
    for i in np.flatnonzero(wanted != NO_LOGPROBS).tolist():
        slot = int(inputs.slots[i])
        start, end = int(inputs.query_start_loc[i]), int(inputs.query_start_loc[i + 1])
        positions = inputs.positions_np[start:end]
        valid = positions + 1 < table.num_prompt_tokens[slot]
        if not valid.any():
            continue
        rows = torch.from_numpy(np.arange(start, end)[valid]).to(hidden.device)
        targets = torch.from_numpy(table.token_ids[slot, positions[valid] + 1].astype(np.int64))
        logprobs = compute_logits(hidden[rows]).to(torch.float32).log_softmax(dim=-1)
        k = int(wanted[i]) if wanted[i] != -1 else vocab_size
        out[inputs.req_ids[i]] = gather_logprobs(logprobs, targets.to(hidden.device), k)
    return out
