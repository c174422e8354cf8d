"""The CPU backend's C decode kernel (paged cache read in place) against plain per-request
attention; the plan's checks of block ids; the fallbacks (other dtypes, no compiler)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from test_gpu_attention_ref import MIXED_LENS, MIXED_NEW, _batch, _reference

from ringserve.gpu.attention import cpu_native
from ringserve.gpu.attention.backend import (
    CpuAttentionBackend,
    TorchAttentionBackend,
    select_backend,
)

pytestmark = pytest.mark.skipif(cpu_native.load_kernel() is None,
                                reason="the CPU kernel does not build here (no cc/OpenMP)")


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (4, 4, 8), (8, 1, 64)])
def test_kernel_matches_per_request_attention(heads: int, kv_heads: int, dim: int) -> None:
    # Lengths on both sides of block boundaries, a 1-key sequence, one long outlier, a prefill
    # chunk (request 4, torch path) and stale table entries past each request's blocks.
    cache, tables, qsl, meta = _batch(MIXED_LENS, MIXED_NEW, kv_heads=kv_heads, dim=dim,
                                      stale=10**6)
    query = torch.randn(qsl[-1], heads, dim)
    backend = CpuAttentionBackend()
    got = backend.attend(query, cache, meta, dim**-0.5)
    want = _reference(query, cache, tables, MIXED_LENS, qsl, dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("group", "kv_heads", "dim"),
                         [(1, 3, 64), (3, 3, 64), (5, 1, 80), (9, 1, 64), (6, 2, 40),
                          (3, 3, 12), (2, 1, 8)])
@pytest.mark.parametrize("lens", [[37], [1, 7, 8, 9, 16, 17, 63, 64, 65, 100, 3, 250]])
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (20, None), (None, 30.0)])
def test_vector_tiles_match_the_torch_backend(group: int, kv_heads: int, dim: int,
                                              lens: list[int], window: int | None,
                                              soft_cap: float | None) -> None:
    # The AVX2 paths: query heads in tiles of up to 4 (5, 6, 9 leave remainders), 16-channel
    # tiles with an 8-channel tail (dim 40, 80), dims off the vector width (12: the scalar
    # loops), lengths around the 8-position chunks and the blocks, one decode (a task per kv
    # head) and twelve (a task per decode), a sliding window and a soft cap.
    cache, _tables, _qsl, meta = _batch(lens, [1] * len(lens), kv_heads=kv_heads, dim=dim,
                                        stale=10**6)
    query = torch.randn(len(lens), group * kv_heads, dim)
    options = {"sliding_window": window, "logits_soft_cap": soft_cap}
    got = CpuAttentionBackend().attend(query, cache, meta, dim**-0.5, **options)
    want = TorchAttentionBackend().attend(query, cache, meta, dim**-0.5, **options)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_non_contiguous_query_and_plan_reuse() -> None:
    cache, tables, qsl, meta = _batch([5, 40, 17], [1, 1, 1])
    wide = torch.randn(qsl[-1], 8, 16)
    query = wide[:, ::2]  # a strided view, as a slice of a fused projection would be
    backend = CpuAttentionBackend()
    got = backend.attend(query, cache, meta, 0.25)
    torch.testing.assert_close(got, _reference(query.contiguous(), cache, tables, [5, 40, 17],
                                               qsl, 0.25), atol=1e-5, rtol=1e-5)
    first = backend.decode_plans.entry
    backend.attend(query, cache.clone(), meta, 0.25)  # another layer of the same step
    assert first is not None and backend.decode_plans.entry is first


def test_nan_query_gives_nan_in_that_head_only() -> None:
    # The sampler finds NaN logits and fails that request alone: NaN must propagate, and
    # only where it belongs (head 1 shares head 0's keys and values, not its scores).
    cache, _tables, qsl, meta = _batch([9, 30], [1, 1])
    query = torch.randn(qsl[-1], 4, 16)
    query[1, 0, 3] = float("nan")
    got = CpuAttentionBackend().attend(query, cache, meta, 0.25)
    assert torch.isnan(got[1, 0]).all()
    assert not torch.isnan(got[1, 1:]).any() and not torch.isnan(got[0]).any()


def test_bad_block_ids_raise_instead_of_reading_out_of_bounds() -> None:
    cache, _tables, _qsl, meta = _batch([20, 9], [1, 1])
    meta.block_table[1, 0] = cache.shape[1]  # one past the last block
    with pytest.raises(ValueError, match="block id outside the cache"):
        cpu_native.plan_decodes(meta, cache)
    meta.block_table[1, 0] = -1
    with pytest.raises(ValueError, match="block id outside the cache"):
        cpu_native.plan_decodes(meta, cache)
    cache2, _t, _q, short = _batch([20], [1])
    with pytest.raises(ValueError, match="does not fit its block table"):
        cpu_native.plan_decodes(short, cache2[:, :, :8])  # 8-token blocks: 3 needed, 2 held


def test_mismatched_shapes_raise() -> None:
    cache, _tables, qsl, meta = _batch([20, 9], [1, 1])
    backend = CpuAttentionBackend()
    for query in (torch.randn(qsl[-1] - 1, 4, 16),  # fewer rows than the step's decodes
                  torch.randn(qsl[-1], 3, 16),  # heads not a multiple of the kv heads
                  torch.randn(qsl[-1], 4, 8)):  # another head size
        with pytest.raises(ValueError, match="does not fit the cache"):
            backend.attend(query, cache, meta, 0.25)


def test_other_dtypes_take_the_torch_path() -> None:
    cache, _tables, qsl, meta = _batch([20, 33], [1, 1])
    query = torch.randn(qsl[-1], 4, 16)
    got = CpuAttentionBackend().attend(query.bfloat16(), cache.bfloat16(), meta, 0.25)
    want = TorchAttentionBackend().attend(query.bfloat16(), cache.bfloat16(), meta, 0.25)
    torch.testing.assert_close(got, want)


def test_selection_and_fallback_without_a_compiler(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert select_backend(torch.device("cpu")).name == "cpu"
    assert select_backend(torch.device("cpu"), "torch").name == "torch"
    monkeypatch.setenv("RINGSERVE_ATTENTION_BACKEND", "torch")
    assert select_backend(torch.device("cpu")).name == "torch"
    assert select_backend(torch.device("cpu"), "cpu").name == "cpu"  # the argument wins
    monkeypatch.setenv("RINGSERVE_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="RINGSERVE_ATTENTION_BACKEND: got 'flash', allowed"):
        select_backend(torch.device("cpu"))
    monkeypatch.delenv("RINGSERVE_ATTENTION_BACKEND")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING):
        assert select_backend(torch.device("cpu")).name == "torch"
    assert "no C compiler" in caplog.text
    with pytest.raises(ValueError, match="needs the CPU device and a C compiler"):
        select_backend(torch.device("cpu"), "cpu")


def test_a_failing_compiler_falls_back_and_leaves_no_temp_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake-cc 1.0 && exit 0\n"
                    "echo 'error: no' >&2; exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("RINGSERVE_HOME", str(tmp_path / "home"))
    with caplog.at_level(logging.WARNING):
        assert cpu_native.load_kernel() is None
    assert "failed: error: no" in caplog.text
    assert list((tmp_path / "home" / "kernels").iterdir()) == []


def test_auto_on_cuda_says_once_that_triton_is_unmeasured(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from ringserve.gpu.attention import backend

    monkeypatch.setattr(backend, "_warned_triton", False)
    monkeypatch.delenv("RINGSERVE_ATTENTION_BACKEND", raising=False)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # one backend per layer: one line per process
            assert select_backend(torch.device("cuda")).name == "triton"
        assert select_backend(torch.device("cuda"), "triton").name == "triton"
    lines = [r.message for r in caplog.records if "not yet been run" in r.message]
    assert len(lines) == 1 and "TRITON_INTERPRET" in lines[0]
