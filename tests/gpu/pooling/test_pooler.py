"""Pooling over a packed batch (`ringserve.gpu.pooling.pooler`) against a loop over the
inputs, and the embedding / classifier finishing steps."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ringserve.gpu.pooling.pooler import activate, finish_embedding, pool


def _batch() -> tuple[torch.Tensor, np.ndarray]:
    lengths = [1, 5, 3, 1, 17]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return torch.randn(int(starts[-1]), 8, generator=torch.Generator().manual_seed(0)), starts


@pytest.mark.parametrize("kind", ["CLS", "MEAN", "LAST"])
def test_pool_matches_a_loop_over_inputs(kind: str) -> None:
    hidden, starts = _batch()
    rows = [hidden[a:b] for a, b in itertools.pairwise(starts)]
    expected = torch.stack([r[0] if kind == "CLS" else r[-1] if kind == "LAST"
                            else r.mean(0) for r in rows])
    out = pool(hidden, starts, kind)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(pool(hidden.bfloat16(), starts, kind), expected,
                               atol=2e-2, rtol=2e-2)


def test_pool_refuses_bad_input() -> None:
    hidden, starts = _batch()
    with pytest.raises(ValueError, match="pooling_type: got 'MAX'"):
        pool(hidden, starts, "MAX")
    with pytest.raises(ValueError, match="at least one token"):
        pool(hidden, np.array([0, 0, hidden.shape[0]]), "MEAN")
    with pytest.raises(ValueError, match="query_start_loc"):
        pool(hidden, np.array([0, 3]), "CLS")


def test_finish_embedding_truncates_then_normalises() -> None:
    vectors = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(finish_embedding(vectors, True, 4),
                               F.normalize(vectors[:, :4], dim=-1))
    torch.testing.assert_close(finish_embedding(vectors, False, None), vectors)
    torch.testing.assert_close(finish_embedding(vectors, True, None), F.normalize(vectors))
    assert finish_embedding(torch.zeros(1, 8), True, None).abs().sum() == 0  # eps, no NaN
    with pytest.raises(ValueError, match=r"dimensions: got 9, allowed: 1\.\.8"):
        finish_embedding(vectors, True, 9)


def test_activate_softmax_for_several_labels_sigmoid_for_one() -> None:
    logits = torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(activate(logits), torch.softmax(logits, -1))
    torch.testing.assert_close(activate(torch.tensor([[0.3], [-2.0]])),
                               torch.sigmoid(torch.tensor([[0.3], [-2.0]])))
    assert activate(logits.bfloat16()).dtype == torch.float32
