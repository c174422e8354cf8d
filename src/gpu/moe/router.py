"""Top-k routing of tokens to experts, computed exactly as transformers' routers do.

Qwen2-MoE / Qwen3-MoE (`norm_topk_prob` optional) and Mixtral (always renormalised) all take a
float32 softmax over the router logits, keep the `top_k` largest probabilities and, when
renormalising, divide them by their sum. The same ops in the same order, so the experts chosen
for a token (ties included) are the ones transformers chooses.
"""

from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts of each token and their weights.

    Args:
        router_logits: [T, E] router outputs.
        top_k: experts per token.
        renormalize: divide the kept probabilities by their sum.
        dtype: the dtype of the returned weights (the activations' dtype).

    Returns:
        (topk_weights [T, top_k] in `dtype`, topk_ids [T, top_k] int64).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids
