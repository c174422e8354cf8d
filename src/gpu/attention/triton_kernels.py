# Triton parses kernel signatures itself (annotations would become constexpr hints), so the
# @triton.jit kernels below stay unannotated; the typed wrappers are the public API.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton kernels: the KV cache write and one unified paged-attention kernel.

Same contract and KV layout as the torch reference (`ringserve.gpu.attention.torch_ref`):
cache `[2, num_blocks, block_size, num_kv_heads, head_dim]`, slot = block * block_size +
offset. `paged_attention` serves prefill chunks and decodes in one launch: one program per
(query token, KV head) handles the whole GQA group of that head, walks the request's block
table one page at a time up to the token's own position (causal) and keeps an online softmax
in float32. Scores use broadcast products and reductions rather than `tl.dot`, so any
block_size / group size works (and the interpreter, whose bf16 `tl.dot` is wrong, agrees).

A sliding window (a token at position p sees keys p - window + 1 .. p) starts the page walk at
the window's first page and masks the keys before it; a logit soft-cap maps the scaled scores
through cap * tanh(score / cap). Both are constexpr switches (`USE_WINDOW`, `USE_SOFT_CAP`), so
the kernel compiled without them is the one without either.

Tested on CPU under `TRITON_INTERPRET=1` (the variable must be set before this module is
imported) and on CUDA under the `gpu` marker, both against the torch reference.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ringserve.gpu.attention.metadata import AttentionMetadata
from ringserve.gpu.attention.torch_ref import check_options


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_key, stride_value, value_offset,
    HD: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HD
    k = tl.load(key_ptr + t * stride_key + offs, mask=mask)
    v = tl.load(value_ptr + t * stride_value + offs, mask=mask)
    tl.store(cache_ptr + slot * HD + offs, k, mask=mask)
    tl.store(cache_ptr + value_offset + slot * HD + offs, v, mask=mask)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store `key`/`value` [T, Hkv, D] into `kv_cache` at `slot_mapping` [T]."""
    t, heads, dim = key.shape
    if t == 0:
        return
    key, value = _rows_contiguous(key), _rows_contiguous(value)
    hd = heads * dim
    grid: Any = (t,)
    _write_kv_kernel[grid](
        key, value, kv_cache, slot_mapping,
        key.stride(0), value.stride(0), kv_cache[0].numel(),
        HD=hd, BLOCK=triton.next_power_of_2(hd),
    )


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


@triton.jit
def _paged_attention_kernel(
    q_ptr, cache_ptr, out_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr, token_req_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_blk, stride_slot, stride_head, value_offset, scale, window, soft_cap,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(token_req_ptr + t)
    q_end = tl.load(qsl_ptr + req + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    num_keys = seq_len - (q_end - t) + 1  # causal: up to and including this token
    first_key = 0
    first_page = 0
    if USE_WINDOW:
        # This token sits at position num_keys - 1; its window starts window - 1 before.
        first_key = tl.maximum(num_keys - window, 0)
        first_page = first_key // BLOCK_SIZE * BLOCK_SIZE
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_SIZE)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    ).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(first_page, num_keys, BLOCK_SIZE):
        block = tl.load(block_table_ptr + req * stride_bt + start // BLOCK_SIZE).to(tl.int64)
        key_mask = (start + offs_s) < num_keys
        if USE_WINDOW:
            key_mask = key_mask & ((start + offs_s) >= first_key)
        base = cache_ptr + block * stride_blk + kv_head * stride_head
        offs = offs_s[:, None] * stride_slot + offs_d[None, :]
        kv_mask = key_mask[:, None] & d_mask[None, :]
        k = tl.load(base + offs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(base + value_offset + offs, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        if USE_SOFT_CAP:
            # tanh(x) = 2 sigmoid(2x) - 1 (no tanh in triton.language); saturates to +-1.
            scores = soft_cap * (2.0 * tl.sigmoid(2.0 * (scores / soft_cap)) - 1.0)
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / denom[:, None]
    tl.store(
        out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :],
    )


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
    sliding_window: int | None = None, logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention of `query` [T, Hq, D] (see the module docstring).

    Args:
        sliding_window: a token at position p sees keys p - sliding_window + 1 .. p only.
        logits_soft_cap: scores become cap * tanh(scores / cap) before the softmax.

    Raises:
        ValueError: a bad window or soft-cap (`torch_ref.check_options`).
    """
    check_options(sliding_window, logits_soft_cap)
    t, num_heads, dim = query.shape
    out = torch.empty_like(query)
    if t == 0:
        return out
    query = _rows_contiguous(query)
    _, _, block_size, kv_heads, _ = kv_cache.shape
    group = num_heads // kv_heads
    grid: Any = (t, kv_heads)
    _paged_attention_kernel[grid](
        query, kv_cache, out, meta.block_table, meta.seq_lens, meta.query_start_loc,
        meta.token_to_req,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_table.stride(0),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(0), scale,
        sliding_window or 0, logits_soft_cap or 1.0,
        GROUP=group, HEAD_DIM=dim, BLOCK_SIZE=block_size,
        BLOCK_G=max(triton.next_power_of_2(group), 1), BLOCK_D=triton.next_power_of_2(dim),
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=logits_soft_cap is not None,
    )
    return out
