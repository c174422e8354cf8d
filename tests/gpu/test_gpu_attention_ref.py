"""The torch reference's batched decode path (length-grouped, padded SDPA) against plain
per-request attention, for decodes of very different lengths mixed with a prefill chunk."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringserve.gpu.attention import torch_ref
from ringserve.gpu.attention.metadata import AttentionMetadata


def _reference(query: torch.Tensor, cache: torch.Tensor, tables: list[list[int]],
               seq_lens: list[int], qsl: list[int], scale: float) -> torch.Tensor:
    out = torch.empty_like(query)
    block_size = cache.shape[2]
    for i, seq_len in enumerate(seq_lens):
        keys = torch.cat([cache[0, b] for b in tables[i]])[:seq_len].transpose(0, 1)
        values = torch.cat([cache[1, b] for b in tables[i]])[:seq_len].transpose(0, 1)
        q = query[qsl[i]:qsl[i + 1]].transpose(0, 1)
        n = q.shape[1]
        mask = torch.arange(seq_len)[None, :] <= torch.arange(n)[:, None] + seq_len - n
        heads = q.shape[0] // keys.shape[0]
        attn = F.scaled_dot_product_attention(
            q, keys.repeat_interleave(heads, 0), values.repeat_interleave(heads, 0),
            attn_mask=mask, scale=scale)
        out[qsl[i]:qsl[i + 1]] = attn.transpose(0, 1)
        assert block_size * len(tables[i]) >= seq_len
    return out


def test_grouped_batched_decode_matches_per_request_attention() -> None:
    torch.manual_seed(0)
    block_size, kv_heads, heads, dim = 16, 2, 4, 16
    seq_lens = [5, 900, 7, 300, 20, 33, 2100]  # request 3 is a 4-token prefill chunk
    new = [1, 1, 1, 4, 1, 1, 1]
    tables, next_block = [], 1
    for n in seq_lens:
        count = -(-n // block_size)
        tables.append(list(range(next_block, next_block + count))[::-1])  # scattered order
        next_block += count
    cache = torch.randn(2, next_block, block_size, kv_heads, dim)
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, row in enumerate(tables):
        table[i, : len(row)] = torch.tensor(row)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
        token_to_req=torch.zeros(qsl[-1], dtype=torch.int32), max_query_len=4,
        max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )
    query = torch.randn(qsl[-1], heads, dim)
    got = torch_ref.paged_attention(query, cache, meta, dim**-0.5)
    want = _reference(query, cache, tables, seq_lens, qsl, dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    groups = torch_ref._length_groups([0, 1, 2, 4, 5, 6], seq_lens)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 4, 5, 6]
    assert len(groups) > 1  # 5 vs 2100 keys are not padded into one call
