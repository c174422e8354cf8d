"""The sampler's large-vocabulary paths against straightforward references: top-k / top-p from
`torch.topk` candidates vs a full sort, seeded draws vs the plain exponential race over the
full row, and logprobs on the asking rows only vs a full log_softmax (issue 17, item 3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringserve.gpu.runner.request_state import RequestTable
from ringserve.gpu.sample.sampler import Sampler, SamplerOutput
from ringserve.gpu.sample.sampling_metadata import SamplingMetadata, build_sampling_metadata
from ringserve.gpu.sample.sampling_ops import SMALL_K, apply_top_k_top_p
from ringserve.gpu.wire import NewRequestData
from ringserve.sampling_params import SamplingParams

VOCAB = 1024
INF = float("-inf")


def _meta(params: list[SamplingParams], vocab: int = VOCAB) -> SamplingMetadata:
    table = RequestTable(max_num_reqs=len(params), max_model_len=16, block_size=4,
                         eos_token_ids=(0,), device=torch.device("cpu"))
    for i, p in enumerate(params):
        table.apply_new(NewRequestData(f"r{i}", [1, 2], p, [0], 0, []))
    return build_sampling_metadata(table, np.arange(len(params)), vocab, torch.device("cpu"))


def _reference_truncate(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p by a full stable sort (equal logits: the lower id ranks higher)."""
    order = logits.argsort(dim=-1, descending=True, stable=True)
    desc = logits.gather(1, order)
    kth = desc.gather(1, (k.clamp(1, logits.shape[1]) - 1).unsqueeze(1))
    asc = desc.masked_fill(desc < kth, INF).flip(-1)
    drop = asc.softmax(dim=-1).cumsum(dim=-1) <= (1 - p[:, None])
    drop[:, -1] = False
    return torch.full_like(logits, INF).scatter_(1, order.flip(-1), asc.masked_fill(drop, INF))


def _random_logits(n: int, seed: int) -> torch.Tensor:
    logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    logits[1, ::3] = INF  # masked (grammar / bad words)
    logits[2, 10:] = INF  # fewer finite entries than top-k
    return logits


def test_topk_candidates_equal_a_full_sort_bit_for_bit() -> None:
    logits = _random_logits(12, seed=0)
    k = torch.tensor([1, 5, 50, SMALL_K, 7, 50, 3, 40, 2, 50, 100, 9])
    p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.0001, 0.9, 1.0, 0.8, 0.3, 0.99, 0.7, 0.6])
    got = apply_top_k_top_p(logits.clone(), k, p)
    assert torch.equal(got, _reference_truncate(logits, k, p))


def test_ties_large_k_and_top_p_alone_equal_the_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(8, VOCAB, generator=gen) * 4).round() / 2  # many equal logits
    k = torch.tensor([5, 50, VOCAB, SMALL_K + 1, 3, VOCAB, 20, VOCAB + 5])
    p = torch.tensor([0.9, 0.6, 0.9, 0.8, 1.0, 1.0, 0.4, 0.5])
    got = apply_top_k_top_p(logits.clone(), k, p)
    ref = _reference_truncate(logits, k, p)
    # k >= V and p = 1 leave the row untouched
    assert torch.equal(got[5], logits[5])
    # Here the k-th value's tie group mostly runs past the candidates, so rows are sorted, and
    # which of two equal logits a cut keeps follows the sort: compare the kept values.
    for row in range(8):
        kept = got[row][got[row] > INF].sort().values
        assert torch.equal(kept, ref[row][ref[row] > INF].sort().values)


def test_a_top_p_cut_between_equal_logits_keeps_the_lower_id() -> None:
    logits = torch.full((1, VOCAB), INF)
    logits[0, [7, 3, 900]] = torch.tensor([2.0, 1.0, 1.0])
    got = apply_top_k_top_p(logits.clone(), torch.tensor([10]), torch.tensor([0.7]))
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [3, 7]


def _reference_seeded(logits: torch.Tensor, params: SamplingParams) -> int:
    """The exponential race over the full truncated row, q from the request's own seed."""
    row = logits.unsqueeze(0) / params.temperature
    k = torch.tensor([params.top_k if params.top_k > 0 else VOCAB])
    row = _reference_truncate(row, k, torch.tensor([params.top_p]))
    assert params.seed is not None
    q = torch.empty(1, VOCAB).exponential_(generator=torch.Generator().manual_seed(params.seed))
    return int(row.softmax(dim=-1).div(q).argmax())


def _mixed_batch() -> tuple[list[SamplingParams], torch.Tensor, SamplerOutput]:
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=11),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.2, top_p=0.9, seed=12),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=5, seed=13, logprobs=2),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.6, top_k=SMALL_K + 10, top_p=0.95, seed=14),
    ]
    logits = _random_logits(len(params), seed=2)
    return params, logits, Sampler().forward(logits.clone(), _meta(params))


def test_mixed_batch_rows_match_their_references() -> None:
    params, logits, out = _mixed_batch()
    assert out.token_ids[[0, 4]].tolist() == logits[[0, 4]].argmax(-1).tolist()
    for row in (1, 3, 5, 7):
        assert out.token_ids[row] == _reference_seeded(logits[row], params[row]), row
    for row in (2, 6):  # unseeded: inside the truncated set
        k = torch.tensor([params[row].top_k if params[row].top_k > 0 else VOCAB])
        kept = _reference_truncate(logits[row : row + 1] / params[row].temperature, k,
                                   torch.tensor([params[row].top_p]))
        assert torch.isfinite(kept[0, int(out.token_ids[row])])


def test_logprobs_only_on_the_rows_that_asked() -> None:
    _, logits, out = _mixed_batch()
    assert out.logprobs is not None
    ref = logits.log_softmax(dim=-1)
    lp = out.logprobs
    for row in (0, 5):
        chosen = int(out.token_ids[row])
        assert lp.token_ids[row, 0] == chosen
        assert lp.logprobs[row, 0] == ref[row, chosen].item()
        assert lp.ranks[row] == int((ref[row] >= ref[row, chosen]).sum())
        np.testing.assert_array_equal(lp.logprobs[row, 1:3], ref[row].topk(2).values.numpy())
    np.testing.assert_array_equal(lp.logprobs[0, 1:], ref[0].topk(3).values.numpy())
    others = [1, 2, 3, 4, 6, 7]
    assert not lp.logprobs[others].any() and not lp.ranks[others].any()
    assert lp.token_ids[others, 0].tolist() == out.token_ids[others].tolist()


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    params, logits, out = _mixed_batch()
    alone = Sampler().forward(logits[[1]].clone(), _meta([params[1]]))
    assert alone.token_ids[0] == out.token_ids[1]


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_candidate_draws_follow_the_truncated_distribution(top_p: float) -> None:
    torch.manual_seed(0)
    n, vocab = 4000, 64
    logits = torch.linspace(0.0, 3.0, vocab).repeat(n, 1)
    meta = _meta([SamplingParams(temperature=1.0, top_k=4, top_p=top_p)] * n, vocab)
    out = Sampler().forward(logits.clone(), meta)
    kept = _reference_truncate(logits[:1], torch.tensor([4]), torch.tensor([top_p]))[0]
    expected = kept.softmax(dim=-1)
    counts = np.bincount(out.token_ids, minlength=vocab) / n
    assert set(np.flatnonzero(counts)) <= set(torch.isfinite(kept).nonzero().flatten().tolist())
    np.testing.assert_allclose(counts, expected.numpy(), atol=0.03)
