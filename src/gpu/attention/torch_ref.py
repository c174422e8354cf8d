"""The torch reference for paged attention: the CPU path and the oracle for the Triton kernels.

KV cache layout (one tensor per layer, allocated by `ringserve.gpu.kv_cache`):
`[2, num_blocks, block_size, num_kv_heads, head_dim]`; index 0 holds keys, 1 values. Token `p`
of a request lives in block `block_table[p // block_size]` at offset `p % block_size`, i.e. in
flat slot `block_id * block_size + offset` of the `[num_blocks * block_size, heads, dim]` view.

`write_kv` scatters the step's new keys/values into their slots; `paged_attention` computes
causal attention of the new queries over each request's whole cached sequence with
`scaled_dot_product_attention` (GQA without copying the KV heads). Single-token queries (decodes)
are batched into one padded call with a length mask, since a Python-level call per request
dominated decode steps (~0.3 ms each on CPU); multi-token queries (prefill chunks) go request by
request.
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
    decodes = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
    if len(decodes) > 1:
        for group in _length_groups(decodes, lens):
            _batched_decode(query, kv_cache, meta, scale, group, out)
    done = set(decodes) if len(decodes) > 1 else set()
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        if start == end or i in done:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_table[i, :num_blocks].long()
        k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:seq_len].transpose(0, 1)
        v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:seq_len].transpose(0, 1)
        q = query[start:end].transpose(0, 1)
        out[start:end] = _attend(q, k.to(q.dtype), v.to(q.dtype), seq_len, scale).transpose(0, 1)
    return out


# A padded decode call costs about this many key positions of work in fixed overhead; a group
# is split when the padding it would save is worth more than one more call.
_CALL_COST_KEYS = 2048


def _length_groups(rows: list[int], lens: list[int]) -> list[list[int]]:
    """Split decode rows into groups of similar sequence length (less padding per call)."""
    order = sorted(rows, key=lambda i: lens[i])
    groups: list[list[int]] = [[]]
    for i in order:
        group = groups[-1]
        if group:
            # Work if i joins (everyone padded to lens[i]) vs. starting a new group.
            waste = (lens[i] - lens[group[-1]]) * len(group)
            if waste > _CALL_COST_KEYS:
                groups.append([i])
                continue
        group.append(i)
    return groups


def _batched_decode(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    rows: list[int], out: torch.Tensor,
) -> None:
    """One SDPA call for every single-token query: keys padded to the longest, masked."""
    block_size = kv_cache.shape[2]
    lens = [meta.seq_lens_cpu[i] for i in rows]
    max_len = max(lens)
    num_blocks = -(-max_len // block_size)
    idx = torch.tensor(rows, dtype=torch.long, device=query.device)
    blocks = meta.block_table[idx, :num_blocks].reshape(-1).long()  # [B * nb]
    heads, dim = kv_cache.shape[-2], kv_cache.shape[-1]
    shape = (len(rows), num_blocks * block_size, heads, dim)
    # index_select on the block axis is ~2x faster than advanced indexing here (measured).
    k = kv_cache[0].index_select(0, blocks).view(shape).transpose(1, 2)
    v = kv_cache[1].index_select(0, blocks).view(shape).transpose(1, 2)
    seq_lens = torch.tensor(lens, device=query.device)
    positions = torch.arange(num_blocks * block_size, device=query.device)
    mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    token_rows = torch.tensor([meta.query_start_loc_cpu[i] for i in rows], dtype=torch.long,
                              device=query.device)
    q = query[token_rows].unsqueeze(2)  # [B, Hq, 1, D]
    attn = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
    )
    out[token_rows] = attn.squeeze(2)


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
