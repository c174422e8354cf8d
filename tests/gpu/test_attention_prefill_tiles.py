"""The torch reference's prefill path (`torch_ref._prefill`): 4-D SDPA calls, a fresh prompt in
one causal call, anything else in tiles of query rows, against a dense float64 softmax with a
mask built from each query's absolute position.

Tiles are forced small (5 query rows; a few rows per soft-capped tile) so that chunks span
several tiles, none a multiple of the tile: a fresh prompt, chunks after cached context (one
starting mid-block), chunks crossing a sliding window, with and without a logit soft-cap, GQA
and plain multi-head, in float32 and bfloat16, mixed with decodes in one `paged_attention` call.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from ringserve.gpu.attention import torch_ref
from ringserve.gpu.attention.metadata import AttentionMetadata

BLOCK = 4
TILE = 5
# (cached context, new tokens): a fresh 23-token prompt, a 13-token chunk after 17 tokens
# (starting mid-block), decodes, a 2-token fresh prompt, an 11-token chunk after 8 (at a
# block boundary), and a 1-token sequence.
REQUESTS = [(0, 23), (17, 13), (40, 1), (0, 2), (3, 1), (8, 11), (0, 1)]
# Narrower than every chunk (each chunk crosses its window), and wider than every sequence.
WINDOWS = [None, 3, 7, 64]
CAP = 2.0  # small enough to bend most scores (queries are scaled up)
# Worst float64-reference error seen, about 2.5x under these: float32 8e-7, bfloat16 1.3e-2
# (bf16 inputs are exact in the reference: that is bf16 rounding inside SDPA and of the output).
TOLERANCE = {torch.float32: {"atol": 2e-6, "rtol": 1e-5},
             torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_ref, "_PREFILL_TILE", TILE)
    # 4 query heads x 2 rows x 30 keys: one to three rows per soft-capped tile here.
    monkeypatch.setattr(torch_ref, "_CAPPED_SCORES", 4 * 2 * 30 + 7)


def make_batch(
    requests: list[tuple[int, int]], heads: int, kv_heads: int, dtype: torch.dtype,
    dim: int = 8, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[list[int]]]:
    """(query [T, heads, dim], cache with blocks scattered, metadata, block tables)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-(c + n) // BLOCK) for c, n in requests]
    order = torch.randperm(sum(counts), generator=gen).tolist()
    tables, used = [], 0
    for count in counts:
        tables.append(order[used:used + count])
        used += count
    cache = torch.randn(2, used, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    qsl = [0]
    for _c, n in requests:
        qsl.append(qsl[-1] + n)
    seq_lens = [c + n for c, n in requests]
    # Entries past each request's blocks lie outside the cache: reading one fails.
    table = torch.full((len(requests), max(counts) + 1), used + 1000, dtype=torch.int32)
    for i, row in enumerate(tables):
        table[i, : len(row)] = torch.tensor(row)
    query = (3 * torch.randn(qsl[-1], heads, dim, generator=gen)).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.long),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
        token_to_req=torch.zeros(qsl[-1], dtype=torch.int32),
        max_query_len=max(n for _c, n in requests), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )
    return query, cache, meta, tables


def dense_reference(
    query: torch.Tensor, cache: torch.Tensor, tables: list[list[int]],
    requests: list[tuple[int, int]], scale: float, window: int | None, cap: float | None,
) -> torch.Tensor:
    """Float64 softmax over explicitly masked scores, request by request."""
    out = torch.empty(query.shape, dtype=torch.float64)
    group = query.shape[1] // cache.shape[3]
    start = 0
    for i, (context, new) in enumerate(requests):
        seq_len = context + new
        slots = [tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len)]
        k = cache[0].flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        v = cache[1].flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", query[start:start + new].double(), k) * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        q_pos = torch.arange(context, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
        out[start:start + new] = torch.einsum("hnl,lhd->nhd", probs, v)
        start += new
    return out


class Calls:
    """What the prefill path handed to SDPA and to the soft-capped path (a recording spy)."""

    def __init__(self) -> None:
        self.sdpa: list[dict[str, Any]] = []
        self.capped: list[tuple[torch.Tensor, torch.Tensor]] = []


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    record = Calls()
    sdpa, capped = F.scaled_dot_product_attention, torch_ref._capped

    def spy_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        record.sdpa.append({"q": q, "k": k, "v": v, **kw})
        return sdpa(q, k, v, **kw)

    def spy_capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, scale: float, cap: float) -> torch.Tensor:
        record.capped.append((q, k))
        return capped(q, k, v, mask, scale, cap)

    monkeypatch.setattr(torch_ref.F, "scaled_dot_product_attention", spy_sdpa)
    monkeypatch.setattr(torch_ref, "_capped", spy_capped)
    yield record


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cap", [None, CAP], ids=["nocap", "cap"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_mixed_batch_matches_dense_reference(
    heads: int, kv_heads: int, window: int | None, cap: float | None, dtype: torch.dtype,
) -> None:
    query, cache, meta, tables = make_batch(REQUESTS, heads, kv_heads, dtype)
    got = torch_ref.paged_attention(query, cache, meta, 8**-0.5, sliding_window=window,
                                    logits_soft_cap=cap)
    assert got.dtype == dtype
    want = dense_reference(query, cache, tables, REQUESTS, 8**-0.5, window, cap)
    torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("window", [None, 7])
def test_prefill_calls_are_4d_tiles_over_the_keys_they_see(
    calls: Calls, window: int | None,
) -> None:
    # Only the 13-token chunk after 17 tokens of context: tiles of 5, 5 and 3 rows.
    query, cache, meta, _ = make_batch([(17, 13)], 6, 2, torch.float32)
    torch_ref.paged_attention(query, cache, meta, 0.3, sliding_window=window)
    rows = [c["q"].shape[2] for c in calls.sdpa]
    assert rows == [5, 5, 3]
    ends = [22, 27, 30]  # one past the last position of each tile's rows
    starts = [0, 0, 0] if window is None else [p - window + 1 for p in (17, 22, 27)]
    for call, start, end in zip(calls.sdpa, starts, ends, strict=True):
        assert call["q"].dim() == 4 and call["k"].shape[1] == 2  # GQA: KV heads not copied
        assert call["enable_gqa"] and not call.get("is_causal", False)
        # Keys from the block holding the window's first position (blocks of 4) to the tile's
        # last row; the mask is the tile's rows by those keys.
        first = 0 if window is None else (17 - window + 1) // BLOCK * BLOCK
        assert call["k"].shape[2] == end - max(start, first)
        assert call["attn_mask"].shape == (call["q"].shape[2], call["k"].shape[2])


def test_fresh_prompt_is_one_causal_call(calls: Calls) -> None:
    query, cache, meta, _ = make_batch([(0, 23)], 6, 2, torch.bfloat16)
    torch_ref.paged_attention(query, cache, meta, 0.3)
    [call] = calls.sdpa
    assert call["q"].shape == (1, 6, 23, 8) and call["k"].shape == (1, 2, 23, 8)
    assert call["is_causal"] and call["enable_gqa"] and call.get("attn_mask") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_torch_picks_the_flash_kernel_for_prefill_calls(calls: Calls, dtype: torch.dtype) -> None:
    """The reason for 4-D calls: on CPU, 3-D input (or an unsupported mask) falls back to the
    math kernel, which materializes [heads, rows, keys] scores."""
    query, cache, meta, _ = make_batch([(0, 23), (17, 13)], 6, 2, dtype)
    torch_ref.paged_attention(query, cache, meta, 0.3, sliding_window=7)
    torch_ref.paged_attention(query, cache, meta, 0.3)
    assert len(calls.sdpa) == 5 + 3 + 1 + 3  # windowed: 5 + 3 tiles; global: 1 + 3
    for call in calls.sdpa:
        choice = torch._fused_sdp_choice(
            call["q"], call["k"], call["v"], call.get("attn_mask"), 0.0,
            call.get("is_causal", False), scale=call["scale"], enable_gqa=True)
        assert SDPBackend(choice) == SDPBackend.FLASH_ATTENTION


def test_soft_capped_tiles_hold_bounded_scores(calls: Calls) -> None:
    query, cache, meta, _ = make_batch([(0, 23), (17, 13)], 4, 2, torch.float32)
    torch_ref.paged_attention(query, cache, meta, 0.3, logits_soft_cap=CAP)
    assert not calls.sdpa and len(calls.capped) > 2
    for q, k in calls.capped:
        # Rows per tile from the request's whole key count; each sees only keys up to its
        # last row (causal), so no tile holds more than the budget of scores.
        assert q.shape[1] * q.shape[2] * k.shape[2] <= torch_ref._CAPPED_SCORES
