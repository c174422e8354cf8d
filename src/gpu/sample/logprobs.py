"""Log-probabilities for the wire: top-k ids and values plus the chosen token and its rank.

Used by the sampler (sampled tokens, from the raw model logits as vLLM's default
`raw_logprobs` mode) and by the model runner for prompt logprobs. Column 0 of each row is the
chosen token (sampled, or the next prompt token); columns 1..k the top-k; the rank is the
number of tokens at least as likely as the chosen one (1 = the most likely).
"""

from __future__ import annotations

import numpy as np
import torch

from ringserve.gpu.wire import Logprobs


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> Logprobs:
    """Logprobs of `token_ids` [n] and the top `k` of each row of `logprobs` [n, V].

    Returns:
        a `Logprobs` of numpy arrays: token_ids int32 [n, k + 1], logprobs float32
        [n, k + 1], ranks int32 [n].
    """
    chosen = logprobs.gather(1, token_ids.long().unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=-1)
        ids = torch.cat((token_ids.long().unsqueeze(1), top_ids), dim=1)
        values = torch.cat((chosen, top_values), dim=1)
    else:
        ids, values = token_ids.long().unsqueeze(1), chosen
    return Logprobs(
        token_ids=ids.to(torch.int32).cpu().numpy(),
        logprobs=values.to(torch.float32).cpu().numpy(),
        ranks=ranks.to(torch.int32).cpu().numpy(),
    )


def select_rows(lp: Logprobs, rows: np.ndarray) -> Logprobs:
    """The `Logprobs` restricted to `rows`."""
    return Logprobs(token_ids=lp.token_ids[rows], logprobs=lp.logprobs[rows], ranks=lp.ranks[rows])
