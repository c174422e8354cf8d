"""The torch reference's batched decode path (the per-step gather plan: length-grouped,
padded SDPA calls) against plain per-request attention, for decodes of very different lengths
mixed with a prefill chunk."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringserve.gpu.attention import torch_ref
from ringserve.gpu.attention.backend import TorchAttentionBackend
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
    heads, dim = 4, 16
    seq_lens = [5, 900, 7, 300, 20, 33, 2100]  # request 3 is a 4-token prefill chunk
    cache, tables, qsl, meta = _batch(seq_lens, [1, 1, 1, 4, 1, 1, 1])
    query = torch.randn(qsl[-1], heads, dim)
    got = torch_ref.paged_attention(query, cache, meta, dim**-0.5)
    want = _reference(query, cache, tables, seq_lens, qsl, dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    groups = torch_ref._length_groups([0, 1, 2, 4, 5, 6], seq_lens)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 4, 5, 6]
    assert len(groups) > 1  # 5 vs 2100 keys are not padded into one call


def _batch(seq_lens: list[int], new: list[int], block_size: int = 16, kv_heads: int = 2,
           dim: int = 16, seed: int = 0, stale: int | None = None,
           ) -> tuple[torch.Tensor, list[list[int]], list[int], AttentionMetadata]:
    """A cache with each request's blocks scattered in reverse order, and its metadata.

    `stale`: written into the block table past each request's own blocks (a freed or
    never-used entry), to check that padded positions never read it.
    """
    torch.manual_seed(seed)
    tables, next_block = [], 1
    for n in seq_lens:
        count = -(-n // block_size)
        tables.append(list(range(next_block, next_block + count))[::-1])
        next_block += count
    cache = torch.randn(2, next_block, block_size, kv_heads, dim)
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t in tables)
    table = torch.full((len(tables), width), 0 if stale is None else stale, dtype=torch.int32)
    for i, row in enumerate(tables):
        table[i, : len(row)] = torch.tensor(row)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
        token_to_req=torch.zeros(qsl[-1], dtype=torch.int32), max_query_len=max(new),
        max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )
    return cache, tables, qsl, meta


# Lengths on both sides of block boundaries (block_size 16), a 1-key sequence, equal lengths
# (a group without a mask) and one long outlier; request 4 is a 5-token prefill chunk.
MIXED_LENS = [15, 16, 17, 1, 40, 31, 32, 33, 48, 48, 49, 64, 65, 700]
MIXED_NEW = [1, 1, 1, 1, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1]


def test_decode_groups_across_block_boundaries_match_per_request_attention() -> None:
    cache, tables, qsl, meta = _batch(MIXED_LENS, MIXED_NEW, stale=10**6)
    query = torch.randn(qsl[-1], 4, 16)
    plan = torch_ref.plan_attention(meta, cache)
    assert len(plan.groups) > 1 and [i for i, _ in plan.requests] == [4]
    assert any(g.mask is None for g in plan.groups) and any(g.mask is not None for g in plan.groups)
    got = torch_ref.paged_attention(query, cache, meta, 0.25, plan)
    want = _reference(query, cache, tables, MIXED_LENS, qsl, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_group_byte_cap_splits_without_changing_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lens = [33, 34, 35, 36, 37, 38]
    cache, tables, qsl, meta = _batch(lens, [1] * len(lens))
    query = torch.randn(qsl[-1], 4, 16)
    whole = torch_ref.plan_attention(meta, cache)
    assert len(whole.groups) == 1 and whole.groups[0].whole_batch
    # One position's key and value: 2 * 2 heads * 16 dims * 4 bytes = 256 bytes.
    monkeypatch.setattr(torch_ref, "_GROUP_BYTES", 256 * 38 * 2)
    split = torch_ref.plan_attention(meta, cache)
    assert [g.token_rows.tolist() for g in split.groups] == [[0, 1], [2, 3], [4, 5]]
    want = _reference(query, cache, tables, lens, qsl, 0.25)
    for plan in (whole, split):
        got = torch_ref.paged_attention(query, cache, meta, 0.25, plan)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_backend_builds_one_plan_per_step_and_reuses_it_across_layers() -> None:
    cache, tables, qsl, meta = _batch(MIXED_LENS, MIXED_NEW)
    other_layer = torch.randn_like(cache)
    backend = TorchAttentionBackend()
    query = torch.randn(qsl[-1], 4, 16)
    for layer_cache in (cache, other_layer):
        got = backend.attend(query, layer_cache, meta, 0.25)
        want = _reference(query, layer_cache, tables, MIXED_LENS, qsl, 0.25)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert backend.plans.entry is not None
    first = backend.plans.entry[2]
    backend.attend(query, other_layer, meta, 0.25)
    assert backend.plans.entry[2] is first
    _, _, _, next_meta = _batch(MIXED_LENS, MIXED_NEW)  # the next step's metadata
    backend.attend(query, cache, next_meta, 0.25)
    assert backend.plans.entry[2] is not first
