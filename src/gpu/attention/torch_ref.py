"""The torch reference for paged attention: the CPU path and the oracle for the Triton kernels.

KV cache layout (one tensor per layer, allocated by `ringserve.gpu.kv_cache`):
`[2, num_blocks, block_size, num_kv_heads, head_dim]`; index 0 holds keys, 1 values. Token `p`
of a request lives in block `block_table[p // block_size]` at offset `p % block_size`, i.e. in
flat slot `block_id * block_size + offset` of the `[num_blocks * block_size, heads, dim]` view.

`write_kv` scatters the step's new keys/values into their slots; `paged_attention` computes,
request by request (a loop over requests, not tokens), causal attention of the new queries over
the request's whole cached sequence with `scaled_dot_product_attention` (GQA without copying
the KV heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringserve.gpu.attention.metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store `key`/`value` [T, Hkv, D] into `kv_cache` at `slot_mapping` [T]."""
    heads, dim = kv_cache.shape[-2], kv_cache.shape[-1]
    kv_cache[0].view(-1, heads, dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, heads, dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention of the new queries [T, Hq, D] over each request's cached sequence.

    The cache must already hold this step's keys/values (`write_kv` first).

    Returns:
        [T, Hq, D] in the query's dtype.
    """
    out = torch.empty_like(query)
    block_size = kv_cache.shape[2]
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        if start == end:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_table[i, :num_blocks].long()
        k = kv_cache[0, blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
        v = kv_cache[1, blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
        q = query[start:end].transpose(0, 1)
        out[start:end] = _attend(q, k.to(q.dtype), v.to(q.dtype), seq_len, scale).transpose(0, 1)
    return out


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, scale: float
) -> torch.Tensor:
    num_queries = q.shape[1]
    context = seq_len - num_queries
    mask: torch.Tensor | None = None
    causal = False
    if context == 0:
        causal = num_queries > 1
    elif num_queries > 1:
        rows = torch.arange(num_queries, device=q.device)[:, None] + context
        mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )
