"""apply_bitmask (the worker's grammar mask): xgrammar's kernel and the torch fallback agree
with a per-token loop, for row selection, padded logits and a padded bitmask."""

from __future__ import annotations

import pytest
import torch

from ringserve.gpu.sample import grammar_mask
from ringserve.gpu.sample.grammar_mask import apply_bitmask, apply_bitmask_torch


def _expected(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for j, r in enumerate(rows):
        for t in range(logits.shape[1]):
            word = t // 32
            if word >= bitmask.shape[1] or not (int(bitmask[j, word]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def _random_bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64
                         ).to(torch.int32)


CASES = [  # (logits rows, vocab, bitmask words, rows or None)
    (3, 96, 3, None),
    (4, 100, 4, [3, 0]),        # vocab not a multiple of 32
    (5, 130, 3, [1, 4, 2]),     # logits wider than the bitmask: the tail is forbidden
    (2, 40, 4, [1]),            # bitmask wider than the logits (padding): extra bits ignored
    (3, 64, 2, [2, 0, 1]),
]


@pytest.mark.parametrize("fn", [apply_bitmask, apply_bitmask_torch])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(("n", "vocab", "words", "rows"), CASES)
def test_apply_bitmask_matches_loop(fn: object, dtype: torch.dtype, n: int, vocab: int,
                                    words: int, rows: list[int] | None) -> None:
    k = n if rows is None else len(rows)
    logits = torch.randn(n, vocab).to(dtype)
    bitmask = _random_bitmask(k, words, seed=n * vocab)
    expected = _expected(logits, bitmask, rows if rows is not None else list(range(k)))
    index = None if rows is None else torch.tensor(rows, dtype=torch.int64)
    fn(logits, bitmask, index)  # type: ignore[operator]
    assert torch.equal(logits, expected)


def test_fewer_bitmask_rows_than_logits_leaves_the_rest() -> None:
    logits = torch.randn(4, 64)
    before = logits.clone()
    bitmask = torch.zeros((2, 2), dtype=torch.int32)
    bitmask[:, 0] = 1  # only token 0
    apply_bitmask(logits, bitmask)
    assert torch.isinf(logits[:2, 1:]).all() and torch.equal(logits[:2, 0], before[:2, 0])
    assert torch.equal(logits[2:], before[2:])


def test_fallback_without_xgrammar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar_mask, "_kernel", None)
    monkeypatch.setattr(grammar_mask, "_kernel_loaded", True)
    logits = torch.randn(3, 70)
    bitmask = _random_bitmask(2, 3, seed=7)
    expected = _expected(logits, bitmask, [2, 0])
    apply_bitmask(logits, bitmask, torch.tensor([2, 0]))
    assert torch.equal(logits, expected)


def test_empty_bitmask_is_a_no_op() -> None:
    logits = torch.randn(2, 32)
    before = logits.clone()
    apply_bitmask(logits, torch.zeros((0, 1), dtype=torch.int32), torch.zeros(0, dtype=torch.int64))
    assert torch.equal(logits, before)


@pytest.mark.gpu
def test_apply_bitmask_on_cuda_matches_cpu() -> None:
    logits = torch.randn(6, 8000)
    bitmask = _random_bitmask(3, 250, seed=3)
    rows = torch.tensor([5, 1, 3])
    expected = logits.clone()
    apply_bitmask_torch(expected, bitmask, rows)
    on_gpu = logits.cuda()
    apply_bitmask(on_gpu, bitmask.cuda(), rows.cuda())
    assert torch.equal(on_gpu.cpu(), expected)


@pytest.mark.parametrize(("vocab", "words"), [(8000, 250), (8000, 240), (70, 2), (100, 4),
                                              (33, 1), (64, 3)])
def test_native_kernel_equals_the_torch_reference(vocab: int, words: int) -> None:
    # float32 CPU logits take the C kernel (grammar_mask.c): whole allowed words skipped,
    # whole forbidden words filled, mixed words bit by bit; tokens past the bitmask forbidden.
    from ringserve.gpu.native import panel as panel_native

    if panel_native.load_library() is None:
        pytest.skip("no C compiler: the C kernel is not built here")
    gen = torch.Generator().manual_seed(vocab + words)
    rows_total, k = 9, 5
    logits = torch.randn(rows_total, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (k, words), dtype=torch.int64,
                            generator=gen).to(torch.int32)
    bitmask[:, ::3] = 0
    bitmask[:, 1::4] = -1
    rows = torch.tensor([7, 0, 3, 8, 2])
    native, reference = logits.clone(), logits.clone()
    assert grammar_mask._apply_native(native, bitmask, rows)
    apply_bitmask_torch(reference, bitmask, rows)
    assert torch.equal(native, reference)
    native, reference = logits.clone(), logits.clone()
    assert grammar_mask._apply_native(native[:k], bitmask, None)  # a view: rows 0..k-1
    apply_bitmask_torch(reference[:k], bitmask)
    assert torch.equal(native, reference)
    assert not grammar_mask._apply_native(logits.to(torch.bfloat16), bitmask, rows)
