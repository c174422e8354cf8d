# Triton parses kernel signatures itself (annotations would become constexpr hints), so the
# @triton.jit kernel below stays unannotated; the typed wrappers are the public API.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The expert computation of an MoE layer as a fused Triton grouped GEMM (SwiGLU experts).

Same contract as the CPU path (`ringserve.gpu.moe.grouped.fused_experts`, the oracle of the
tests): `x` [T, H], `w13` [E, 2*I, H] (gate rows, then up rows), `w2` [E, H, I], routing
`topk_weights` / `topk_ids` [T, k]. `moe_align_block_size` orders the T*k (token, slot) pairs by
expert and pads each expert's run to a multiple of the block size, so that every block of
`BLOCK_M` sorted rows belongs to one expert. `_grouped_gemm_kernel` then runs one program per
(row block, column block): it gathers its rows through the sorted pair indices, multiplies them
by that block's expert weights with fp32 accumulation, optionally scales them by the routing
weight and scatters them back to the pair's row. `fused_moe` runs it for gate-up, applies
SiLU-and-mul in torch, runs it for down (weighted), and sums each token's k rows.

The metadata is torch (no host sync: the grid is sized for the worst case and the blocks past
`num_tokens_post_padded` return at once). Tested on CPU under `TRITON_INTERPRET=1` (set before
this module is imported) and on CUDA under the `gpu` marker.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert, each expert's run padded to `block_size`.

    Args:
        topk_ids: [T, k] expert ids in [0, num_experts).
        block_size: rows per block of the grouped GEMM.
        num_experts: E.

    Returns:
        (sorted_token_ids, expert_ids, num_tokens_post_padded). `sorted_token_ids` [S] int32
        holds flattened pair indices (t * k + slot), expert by expert in order of the pairs, each
        expert's run padded with the sentinel T*k up to a multiple of `block_size`; S is the
        worst case T*k + E*(block_size-1) rounded up to a block, and everything past
        `num_tokens_post_padded` is the sentinel too. `expert_ids` [S / block_size] int32: the
        expert of each block, -1 for the blocks past the end. `num_tokens_post_padded` [1]
        int32: the padded length actually used (a tensor, so that nothing waits on the device).
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    max_padded = triton.cdiv(num_pairs + num_experts * (block_size - 1), block_size) * block_size
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    # A pair's place: its expert's padded start plus its rank among that expert's pairs.
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    sorted_token_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids[dest] = order.to(torch.int32)
    blocks = torch.arange(max_padded // block_size, device=device)
    expert_ids = torch.searchsorted(padded_end // block_size, blocks, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_token_ids, expert_ids, padded_end[-1:].to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weight_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
    N, K, num_pairs,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_mask = pair < num_pairs
    a_row = pair // A_ROW_DIV
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    # B is read as [K, N]: the weights are stored [N, K] (out features, in features).
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + pair, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    tl.store(
        c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :],
    )


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                  topk_weights: torch.Tensor | None, align: tuple[torch.Tensor, ...],
                  a_row_div: int, blocks: tuple[int, int, int]) -> None:
    """out[pair] = (a[pair // a_row_div] @ b[expert].T) (* topk_weights[pair]) for each pair."""
    sorted_ids, expert_ids, num_post_padded = align
    block_m, block_n, block_k = blocks
    n, k = b.shape[1], b.shape[2]
    grid: Any = (expert_ids.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, out, topk_weights if topk_weights is not None else out,
        sorted_ids, expert_ids, num_post_padded,
        n, k, out.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=topk_weights is not None,
        # fp32 stays fp32 (not TF32) on tensor cores; the precision is moot for bf16 / fp16.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def _check_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  blocks: tuple[int, int, int]) -> None:
    for name, size in zip(("block_m", "block_n", "block_k"), blocks, strict=True):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's minimum), got {size}")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    e, two_i, h = w13.shape
    if h != x.shape[1] or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"w13 must be [E, 2I, H={x.shape[1]}] and w2 [E, H, I]; got "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] \
            or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights and topk_ids must both be [T={x.shape[0]}, k]; got "
                         f"{tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}")
    if not x.dtype == w13.dtype == w2.dtype:
        raise ValueError(f"x, w13 and w2 must share a dtype; got {x.dtype}, {w13.dtype}, "
                         f"{w2.dtype}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """The weighted sum of each token's experts, as two Triton grouped GEMMs.

    Args:
        x: [T, H] activations (float32, or bfloat16 / float16 on CUDA; fp32 accumulation).
        w13: [E, 2*I, H] stacked gate and up projections; w2: [E, H, I] down projections.
        topk_weights: [T, k] routing weights; topk_ids: [T, k] expert ids in [0, E) (not
            checked: that would wait on the device).
        block_m, block_n, block_k: the GEMM tile, powers of two >= 16.

    Returns:
        [T, H] in x's dtype: sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]).

    Raises:
        ValueError: shapes that do not fit together, mixed dtypes or a bad block size.
    """
    blocks = (block_m, block_n, block_k)
    _check_inputs(x, w13, w2, topk_weights, topk_ids, blocks)
    tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    if tokens == 0:
        return torch.zeros_like(x)
    align = moe_align_block_size(topk_ids, block_m, num_experts)
    pairs = tokens * top_k
    gate_up = x.new_empty((pairs, two_i))
    _grouped_gemm(x, w13, gate_up, None, align, top_k, blocks)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (F.silu(gate) * up).to(x.dtype)
    down = x.new_empty((pairs, hidden))
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(act, w2, down, weights, align, 1, blocks)
    return down.view(tokens, top_k, hidden).sum(1)
