"""Sliding-window attention and logit soft-capping in every attention backend (torch
reference, C decode kernel, Triton under the interpreter), against a dense reference: plain
softmax attention in float64 with a mask built from each query's absolute position.

The batch mixes decodes whose lengths sit around the windows, a chunked prefill continuing a
cached prefix, a fresh prefill and a 1-token sequence; blocks are scattered and the block table
holds out-of-cache ids past each request's blocks, so a read outside a window's pages fails.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringserve.gpu.attention import cpu_native, torch_ref
from ringserve.gpu.attention.backend import (
    AttentionBackend,
    CpuAttentionBackend,
    TorchAttentionBackend,
)
from ringserve.gpu.attention.metadata import AttentionMetadata

HERE = Path(__file__).resolve().parent
BLOCK = 4
# (cached context, new tokens): sequence lengths 1, 7, 8, 9, 17, 9, 31, 9.
REQUESTS = [(0, 1), (6, 1), (7, 1), (8, 1), (12, 5), (0, 9), (30, 1), (3, 6)]
# Smaller than every multi-token sequence, equal to some lengths (8, 9), larger than all.
WINDOWS = [None, 1, 5, 8, 9, 64]
CAP = 2.0  # small enough to bend most of these scores (queries are scaled up below)
HAS_KERNEL = cpu_native.load_kernel() is not None


def make_batch(
    requests: list[tuple[int, int]], heads: int = 4, kv_heads: int = 2, dim: int = 8,
    dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[list[int]]]:
    """(query [T, heads, dim], cache, metadata, block tables) for `requests`."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-(c + n) // BLOCK) for c, n in requests]
    order = torch.randperm(sum(counts), generator=gen).tolist()
    tables, used = [], 0
    for count in counts:
        tables.append(order[used:used + count])
        used += count
    num_blocks = used
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    qsl, token_req = [0], []
    for i, (_c, n) in enumerate(requests):
        qsl.append(qsl[-1] + n)
        token_req += [i] * n
    seq_lens = [c + n for c, n in requests]
    table = torch.full((len(requests), max(counts) + 1), num_blocks + 1000, dtype=torch.int32)
    for i, row in enumerate(tables):
        table[i, : len(row)] = torch.tensor(row)
    query = (3 * torch.randn(qsl[-1], heads, dim, generator=gen)).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.long, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        token_to_req=torch.tensor(token_req, dtype=torch.int32, device=device),
        max_query_len=max(n for _c, n in requests), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )
    return query.to(device), cache.to(device), meta, tables


def dense_reference(
    query: torch.Tensor, cache: torch.Tensor, tables: list[list[int]],
    requests: list[tuple[int, int]], scale: float, window: int | None, cap: float | None,
) -> torch.Tensor:
    """Float64 softmax attention, request by request, masked by absolute positions."""
    out = torch.empty(query.shape, dtype=torch.float64)
    group = query.shape[1] // cache.shape[3]
    start = 0
    for i, (context, new) in enumerate(requests):
        seq_len = context + new
        slots = [tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len)]
        k = cache[0].flatten(0, 1)[slots].double().cpu().repeat_interleave(group, dim=1)
        v = cache[1].flatten(0, 1)[slots].double().cpu().repeat_interleave(group, dim=1)
        q = query[start:start + new].double().cpu()
        scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
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


def _backend(name: str) -> AttentionBackend:
    if name == "cpu":
        if not HAS_KERNEL:
            pytest.skip("the CPU kernel does not build here (no cc/OpenMP)")
        return CpuAttentionBackend()
    return TorchAttentionBackend()


@pytest.mark.parametrize("cap", [None, CAP])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_backend_matches_dense_reference(name: str, window: int | None, cap: float | None) -> None:
    query, cache, meta, tables = make_batch(REQUESTS)
    got = _backend(name).attend(query, cache, meta, 8**-0.5, sliding_window=window,
                                logits_soft_cap=cap)
    want = dense_reference(query, cache, tables, REQUESTS, 8**-0.5, window, cap)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (8, 2), (4, 1)])
@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_gqa_groups_with_window_and_cap(name: str, heads: int, kv_heads: int) -> None:
    query, cache, meta, tables = make_batch(REQUESTS, heads=heads, kv_heads=kv_heads, dim=16)
    got = _backend(name).attend(query, cache, meta, 0.25, sliding_window=5, logits_soft_cap=CAP)
    want = dense_reference(query, cache, tables, REQUESTS, 0.25, 5, CAP)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "cap"), [(None, CAP), (5, None), (5, CAP)])
def test_torch_path_in_bfloat16(window: int | None, cap: float | None) -> None:
    query, cache, meta, tables = make_batch(REQUESTS, dtype=torch.bfloat16)
    got = TorchAttentionBackend().attend(query, cache, meta, 8**-0.5, sliding_window=window,
                                         logits_soft_cap=cap)
    assert got.dtype == torch.bfloat16
    want = dense_reference(query, cache, tables, REQUESTS, 8**-0.5, window, cap)
    torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_chunked_prefill_over_a_cached_prefix_equals_one_prefill(name: str) -> None:
    # One 14-token sequence: prefilled whole, or in chunks [0, 5) and [5, 11) (the second
    # continuing the cached prefix) then decodes at 11, 12, 13: every row must agree.
    backend = _backend(name)
    heads, kv_heads, dim, length = 4, 2, 8, 14
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(length, kv_heads, dim, generator=gen)
    values = torch.randn(length, kv_heads, dim, generator=gen)
    query = 3 * torch.randn(length, heads, dim, generator=gen)
    table = [5, 2, 7, 0]  # positions 0..15, scattered
    slot = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])

    def run(start: int, end: int, cache: torch.Tensor) -> torch.Tensor:
        backend.write_kv(keys[start:end], values[start:end], cache, slot[start:end])
        n = end - start
        meta = AttentionMetadata(
            slot_mapping=slot[start:end], query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_table=torch.tensor([table], dtype=torch.int32),
            token_to_req=torch.zeros(n, dtype=torch.int32), max_query_len=n, max_seq_len=end,
            query_start_loc_cpu=[0, n], seq_lens_cpu=[end],
        )
        return backend.attend(query[start:end], cache, meta, dim**-0.5, sliding_window=4,
                              logits_soft_cap=CAP)

    whole = run(0, length, torch.zeros(2, 8, BLOCK, kv_heads, dim))
    cache = torch.zeros(2, 8, BLOCK, kv_heads, dim)
    pieces = [run(s, e, cache) for s, e in [(0, 5), (5, 11), (11, 12), (12, 13), (13, 14)]]
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-5)


def test_torch_path_without_window_or_cap_is_unchanged() -> None:
    # Bit for bit: no arguments, explicit Nones, and a window past every sequence all take
    # the plain SDPA path over the same gathered keys.
    query, cache, meta, _tables = make_batch(REQUESTS)
    plain = TorchAttentionBackend().attend(query, cache, meta, 0.3)
    explicit = TorchAttentionBackend().attend(query, cache, meta, 0.3, sliding_window=None,
                                              logits_soft_cap=None)
    wide = TorchAttentionBackend().attend(query, cache, meta, 0.3, sliding_window=10**6)
    assert torch.equal(plain, explicit) and torch.equal(plain, wide)
    assert torch.equal(plain, torch_ref.paged_attention(query, cache, meta, 0.3))


def test_windowed_decodes_gather_only_their_window_and_plans_are_kept_per_window() -> None:
    query, cache, meta, _tables = make_batch(REQUESTS)
    plan = torch_ref.plan_attention(meta, cache, 5)
    assert plan.groups and all(g.length <= 5 for g in plan.groups)
    assert sum(g.kv_rows.numel() for g in plan.groups) < sum(
        g.kv_rows.numel() for g in torch_ref.plan_attention(meta, cache).groups)
    backend = TorchAttentionBackend()
    plans = []
    for window in (5, None, 5, None):  # alternating layers of one step (Gemma 2)
        backend.attend(query, cache, meta, 0.3, sliding_window=window)
        assert backend.plans.entry is not None
        plans.append(backend.plans.entry[2])
    assert plans[0] is plans[2] and plans[1] is plans[3] and plans[0] is not plans[1]
    with pytest.raises(ValueError, match="a plan for sliding_window 5 used with sliding_window 6"):
        torch_ref.paged_attention(query, cache, meta, 0.3, plans[0], sliding_window=6)


@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_bad_window_or_cap_raise(name: str) -> None:
    query, cache, meta, _tables = make_batch(REQUESTS)
    backend = _backend(name)
    for window in (0, -3):
        with pytest.raises(ValueError, match=f"sliding_window must be an int >= 1 or None, "
                                             f"got {window}"):
            backend.attend(query, cache, meta, 0.3, sliding_window=window)
    for cap in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="logits_soft_cap must be a finite number > 0"):
            backend.attend(query, cache, meta, 0.3, logits_soft_cap=cap)


# Small for the interpreter: 8 query rows, 2 KV heads (16 programs per launch).
TRITON_REQUESTS = [(6, 1), (0, 3), (5, 3), (8, 1)]


def check_triton(device: str = "cpu", dtype: torch.dtype = torch.float32,
                 atol: float = 2e-5) -> None:
    """The Triton kernel against the dense reference with and without window / soft-cap
    (run under TRITON_INTERPRET=1 on CPU, natively on CUDA)."""
    from ringserve.gpu.attention import triton_kernels

    query, cache, meta, tables = make_batch(TRITON_REQUESTS, dtype=dtype, device=device)
    for window, cap in [(None, None), (4, None), (None, CAP), (2, CAP), (9, CAP)]:
        got = triton_kernels.paged_attention(query, cache, meta, 8**-0.5, sliding_window=window,
                                             logits_soft_cap=cap)
        want = dense_reference(query, cache, tables, TRITON_REQUESTS, 8**-0.5, window, cap)
        err = (got.double().cpu() - want).abs().max().item()
        assert err < atol, f"window {window}, cap {cap}: differs by {err}"
    try:
        triton_kernels.paged_attention(query, cache, meta, 0.3, sliding_window=0)
    except ValueError as exc:
        assert "sliding_window must be an int >= 1" in str(exc)
    else:
        raise AssertionError("sliding_window=0 was accepted")


@pytest.mark.slow
def test_triton_window_and_cap_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = ("import torch, test_attention_window as t; torch.set_num_threads(2); "
            "t.check_triton('cpu')")
    done = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
def test_triton_window_and_cap_on_cuda() -> None:
    check_triton("cuda", torch.float32, atol=1e-4)
    check_triton("cuda", torch.bfloat16, atol=5e-2)
