"""The expert computation of an MoE layer on CPU: tokens grouped by expert, one grouped GEMM
for gate-up and one for down, no Python loop over tokens or experts.

Weights are stacked per expert: `w13` [E, 2*I, H] (gate rows, then up rows, as the checkpoints'
`gate_proj` / `w1` and `up_proj` / `w3`) and `w2` [E, H, I]. Each (token, expert) pair becomes
one row; a stable sort by expert makes every expert's rows contiguous, `torch._grouped_mm` runs
each expert's slice against its own weights in one call, and the weighted rows are summed back
per token with `index_add_`. `per_expert_loop` is the straightforward loop over the experts hit
(what transformers' eager experts do); it is the baseline of `scripts/bench_moe.py` and the
oracle of the tests, as this module is the oracle of the Triton kernel (`triton_moe`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _grouped_mm_usable(x: torch.Tensor) -> bool:
    return hasattr(torch, "_grouped_mm") and x.dtype in (torch.float32, torch.bfloat16)


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Order the (token, slot) pairs by expert.

    Returns:
        (order [P] indices into the flattened [T*k] pairs, token [P] the token of each sorted
        pair, counts [E] pairs per expert); P = T*k.
    """
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, order // topk_ids.shape[1], counts


def grouped_swiglu(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for rows already grouped by expert.

    Args:
        rows: [P, H] activations, the rows of expert e contiguous and in expert order.
        w13: [E, 2*I, H]; w2: [E, H, I].
        counts: [E] rows per expert (summing to P).

    Returns:
        [P, H] expert outputs, row for row.
    """
    if rows.shape[0] == 0:
        return rows.new_empty((0, w2.shape[1]))
    if _grouped_mm_usable(rows):
        offs = counts.cumsum(0).to(torch.int32)
        h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    return _looped_swiglu(rows, w13, w2, counts)


def _looped_swiglu(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
    out = rows.new_empty((rows.shape[0], w2.shape[1]))
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gate, up = F.linear(rows[start:start + n], w13[e]).chunk(2, dim=-1)
            out[start:start + n] = F.linear(F.silu(gate) * up, w2[e])
            start += n
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The weighted sum of each token's experts (SwiGLU experts).

    Args:
        x: [T, H] activations.
        w13: [E, 2*I, H] stacked gate and up projections; w2: [E, H, I] down projections.
        topk_weights: [T, k] routing weights; topk_ids: [T, k] expert ids in [0, E).

    Returns:
        [T, H]: sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]).
    """
    return combine_experts(x, topk_weights, topk_ids, w13.shape[0],
                           lambda rows, counts: grouped_swiglu(rows, w13, w2, counts))


def combine_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    num_experts: int,
                    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`fused_experts` with the experts' computation given: `swiglu(rows, counts)` runs the
    experts on rows grouped by expert (`grouped_swiglu`, or the C kernel of
    `ringserve.gpu.moe.cpu_experts`)."""
    order, token, counts = sort_by_expert(topk_ids, num_experts)
    y = swiglu(x[token], counts)
    y *= topk_weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def per_expert_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """`fused_experts` as a Python loop over the experts hit (the benchmark's baseline)."""
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == e)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * topk_weights[token, slot].unsqueeze(1)
        out.index_add_(0, token, y.to(out.dtype))
    return out
