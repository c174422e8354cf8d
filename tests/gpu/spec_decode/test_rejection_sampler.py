"""The rejection sampler (`sample_with_drafts`) on hand-made logits, through the real request
table and sampler: the emitted tokens follow the target's distribution whatever the drafts
(a chi-square test that also flags two wrong samplers), greedy rows emit the argmax run,
penalties and min_tokens see the accepted drafts, logprob rows line up with the emitted
tokens, and a seeded request emits what the plain sampler draws position by position."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from ringserve.gpu.runner.request_state import RequestTable
from ringserve.gpu.sample.rejection import DraftSampling, sample_with_drafts
from ringserve.gpu.sample.sampler import Sampler
from ringserve.gpu.sample.sampling_metadata import build_sampling_metadata
from ringserve.gpu.wire import NewRequestData
from ringserve.sampling_params import SamplingParams

V = 6
EOS = 5
CPU = torch.device("cpu")
PROMPT = [0, 0]  # token 0 is never a draft or an argmax below: no penalty touches it

# The statistical test's target: a different distribution at each of the 3 positions, and
# adversarial drafts (a 10% token first, then the 55% favourite).
P = torch.tensor([
    [0.30, 0.25, 0.15, 0.12, 0.10, 0.08],
    [0.05, 0.55, 0.10, 0.10, 0.10, 0.10],
    [0.10, 0.10, 0.10, 0.20, 0.20, 0.30],
], dtype=torch.float64)
DRAFTS = [4, 1]
N = 20_000


def _table(params: list[SamplingParams], outputs: list[list[int]] | None = None,
           prompt: list[int] | None = None) -> RequestTable:
    table = RequestTable(max_num_reqs=len(params), max_model_len=32, block_size=4,
                         eos_token_ids=(EOS,), device=CPU)
    for i, p in enumerate(params):
        out = outputs[i] if outputs else []
        table.apply_new(NewRequestData(f"r{i}", prompt or PROMPT, p, [1], 0, out))
    return table


def _layout(logits: list[torch.Tensor]) -> tuple[Callable[[np.ndarray], torch.Tensor],
                                                 list[np.ndarray]]:
    """Request i's logits [1 + k_i, V] stacked as hidden-state rows: (logits_at, rows)."""
    flat = torch.cat(logits).to(torch.float32)
    rows, start = [], 0
    for block in logits:
        rows.append(np.arange(start, start + len(block)))
        start += len(block)

    def logits_at(r: np.ndarray) -> torch.Tensor:
        return flat[torch.from_numpy(r)].clone()

    return logits_at, rows


def _run(params: list[SamplingParams], logits: list[torch.Tensor], drafts: list[list[int]],
         outputs: list[list[int]] | None = None, prompt: list[int] | None = None,
         table: RequestTable | None = None) -> tuple[DraftSampling, RequestTable]:
    table = table if table is not None else _table(params, outputs, prompt)
    logits_at, rows = _layout(logits)
    slots = np.fromiter((table.slot_of(f"r{i}") for i in range(len(params))), np.int64)
    result = sample_with_drafts(logits_at, rows, drafts, slots, table, Sampler(), V, CPU)
    return result, table


# -- the statistic -----------------------------------------------------------------------------


def _chi2_pvalue(counts: np.ndarray, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; the p-value from the regularised gamma."""
    n = counts.sum()
    expected = probs.numpy() * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _tv(counts: np.ndarray, probs: torch.Tensor) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs.numpy()).sum())


def _counts(tokens: list[int]) -> np.ndarray:
    return np.bincount(np.asarray(tokens, dtype=np.int64), minlength=V)


def _fits(samples: list[list[int]]) -> dict[str, float]:
    """The statistic: the first emitted token against softmax(logits[0]), the second given
    that the first was draft 0 against softmax(logits[1]), and the third given that both
    drafts were accepted against softmax(logits[2])."""
    first = _counts([s[0] for s in samples])
    second = _counts([s[1] for s in samples if s[0] == DRAFTS[0] and len(s) > 1])
    third = _counts([s[2] for s in samples if s[:2] == DRAFTS and len(s) > 2])
    return {
        "p_first": _chi2_pvalue(first, P[0]), "tv_first": _tv(first, P[0]),
        "p_second": _chi2_pvalue(second, P[1]), "n_second": float(second.sum()),
        "p_third": _chi2_pvalue(third, P[2]), "n_third": float(third.sum()),
    }


def _real_samples(n: int, logits_at_of: Callable[[torch.Tensor], Callable[[np.ndarray],
                                                                            torch.Tensor]]
                  | None = None) -> list[list[int]]:
    """`n` independent trials: n unseeded requests, each a fresh row, in one batch."""
    torch.manual_seed(1234)  # unseeded rows draw from the global generator
    params = [SamplingParams(temperature=1.0)] * n
    table = _table(params)
    logits = P.log().to(torch.float32)
    logits_at = (lambda r: logits[torch.from_numpy(r % 3)].clone()) if logits_at_of is None \
        else logits_at_of(logits)
    rows = [np.arange(3 * i, 3 * i + 3) for i in range(n)]
    result = sample_with_drafts(logits_at, rows, [DRAFTS] * n, np.arange(n), table, Sampler(),
                                V, CPU)
    assert not result.errors
    return result.sampled


def _naive_resampler(n: int) -> list[list[int]]:
    """WRONG: accept the draft with probability p(d), and on rejection draw again from p
    itself (instead of p without d), so d comes out too often."""
    rng = np.random.default_rng(1234)
    probs = P.numpy()
    out = []
    for _ in range(n):
        emitted: list[int] = []
        for j in range(3):
            if j < len(DRAFTS) and rng.random() < probs[j, DRAFTS[j]]:
                emitted.append(DRAFTS[j])
                continue
            emitted.append(int(rng.choice(V, p=probs[j])))
            break
        out.append(emitted)
    return out


def _always_accept(n: int) -> list[list[int]]:
    """WRONG: every draft accepted, the bonus drawn from the last position."""
    rng = np.random.default_rng(1234)
    return [[*DRAFTS, int(rng.choice(V, p=P[2].numpy()))] for _ in range(n)]


def test_emitted_tokens_follow_the_target_distribution() -> None:
    samples = _real_samples(N)
    fit = _fits(samples)
    assert fit["tv_first"] < 0.02, fit
    # Conditional counts are large enough to mean something (10% and 10% * 55% of N).
    assert fit["n_second"] > 0.08 * N and fit["n_third"] > 0.04 * N, fit
    assert min(fit["p_first"], fit["p_second"], fit["p_third"]) > 1e-3, fit
    # Every trial: accepted drafts then one more token, never more than k + 1.
    for s in samples[:2000]:
        assert 1 <= len(s) <= 3
        assert s[:len(s) - 1] == DRAFTS[:len(s) - 1]
        if len(s) < 3:
            assert s[-1] != DRAFTS[len(s) - 1]  # the correction differs from its draft


def test_the_tv_distance_shrinks_with_samples() -> None:
    samples = _real_samples(N)
    tv = [_tv(_counts([s[0] for s in samples[:n]]), P[0]) for n in (200, N)]
    assert tv[1] < tv[0] and tv[1] < 0.02, tv


@pytest.mark.parametrize("wrong", [_naive_resampler, _always_accept])
def test_the_same_statistic_flags_a_wrong_sampler(
        wrong: Callable[[int], list[list[int]]]) -> None:
    fit = _fits(wrong(N))
    assert fit["tv_first"] > 0.05 and fit["p_first"] < 1e-9, fit


def test_the_same_statistic_flags_a_position_read_from_the_wrong_row() -> None:
    """WRONG: the draft positions sampled from the previous position's logits (an off-by-one
    in the hidden-state rows): the first token is right, the conditional ones are not."""
    def shifted(logits: torch.Tensor) -> Callable[[np.ndarray], torch.Tensor]:
        return lambda r: logits[torch.from_numpy(np.maximum(r % 3 - 1, 0))].clone()

    fit = _fits(_real_samples(N, shifted))
    assert fit["p_first"] > 1e-3, fit
    assert fit["p_second"] < 1e-9, fit


# -- greedy ------------------------------------------------------------------------------------


def _peaked(argmax: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(argmax), V)
    for j, token in enumerate(argmax):
        logits[j, token] = 5.0
    return logits


@pytest.mark.parametrize("general", [False, True], ids=["plain-greedy", "by-position"])
def test_greedy_emits_the_argmax_run(general: bool) -> None:
    # general: logprobs requested, so the by-position loop runs instead of one argmax
    p = SamplingParams(temperature=0.0, logprobs=1 if general else None)
    argmax = [3, 2, 4]
    cases = {
        "all accepted": ([3, 2], [3, 2, 4]),  # k + 1 tokens: the bonus
        "second rejected": ([3, 1], [3, 2]),  # the correction is the argmax
        "first rejected": ([1, 2], [3]),
        "no drafts": ([], [3]),
    }
    drafts = [d for d, _ in cases.values()]
    logits = [_peaked(argmax[:1 + len(d)]) for d in drafts]
    result, table = _run([p] * len(cases), logits, drafts)
    assert result.sampled == [want for _, want in cases.values()]
    assert not result.errors
    for i, (_, want) in enumerate(cases.values()):
        slot = table.slot_of(f"r{i}")  # the emitted tokens were appended to the history
        assert table.token_ids[slot, :table.num_tokens[slot]].tolist() == PROMPT + want


@pytest.mark.parametrize("general", [False, True], ids=["plain-greedy", "by-position"])
@pytest.mark.parametrize("position", [0, 1])
def test_nan_logits_fail_that_request_only(general: bool, position: int) -> None:
    p = SamplingParams(temperature=0.0, logprobs=1 if general else None)
    argmax = [3, 2, 4]
    logits = [_peaked(argmax) for _ in range(3)]
    logits[1][position, 2] = float("nan")
    result, _ = _run([p] * 3, logits, [[3, 2]] * 3)
    assert set(result.errors) == {1} and "NaN" in result.errors[1]
    assert result.sampled == [[3, 2, 4], [], [3, 2, 4]]
    if general:
        assert result.logprobs is not None and len(result.logprobs.token_ids) == 6


@pytest.mark.parametrize("general", [
    pytest.param(False, id="plain-greedy"),
    pytest.param(True, id="by-position"),
])
def test_nan_logits_at_a_position_after_a_rejection_are_never_sampled(general: bool) -> None:
    """A NaN behind the first rejected draft belongs to a position never sampled."""
    p = SamplingParams(temperature=0.0, logprobs=1 if general else None)
    logits = _peaked([3, 2, 4])
    logits[2, 0] = float("nan")
    result, _ = _run([p], [logits], [[3, 1]])
    assert result.sampled == [[3, 2]] and not result.errors


# -- history-dependent processing --------------------------------------------------------------


def test_a_repetition_penalty_at_a_later_position_sees_the_accepted_draft() -> None:
    # Position 1: token 3 leads token 2 by a little; with 3 (draft 0) already in the history
    # a repetition penalty of 2 halves it, and 2 wins.
    logits = torch.zeros(3, V)
    logits[0, 3] = 4.0
    logits[1, 3], logits[1, 2] = 2.0, 1.5
    logits[2, 4] = 4.0
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    result, _ = _run([p], [logits], [[3, 2]])
    assert result.sampled == [[3, 2, 4]]
    # Without the penalty the same drafts stop at position 1 (3 beats 2 there).
    plain, _ = _run([SamplingParams(temperature=0.0)], [logits], [[3, 2]])
    assert plain.sampled == [[3, 3]]
    # The penalty alone does not move position 1 when draft 0 is not in the history.
    alone, _ = _run([p], [logits[1:2]], [[]])
    assert alone.sampled == [[3]]


def test_min_tokens_bans_eos_only_until_reached_inside_the_run() -> None:
    logits = torch.zeros(4, V)
    logits[:, EOS] = 10.0
    logits[:, 3] = 5.0
    p = SamplingParams(temperature=0.0, min_tokens=3)
    # One output already: EOS banned for outputs 2 and 3, allowed from the 4th on.
    result, _ = _run([p], [logits], [[3, 3, 3]], outputs=[[4]])
    assert result.sampled == [[3, 3, EOS]]
    # A stop id ends nothing here: it is only banned while min_tokens is not reached.
    later, _ = _run([p], [logits], [[3, 3, 3]], outputs=[[4, 4, 4]])
    assert later.sampled == [[EOS]]


def test_logprob_rows_align_with_the_emitted_tokens() -> None:
    # r0 wants 5 logprobs and stops at its first draft; r1 wants 1 and accepts both drafts
    # (positions 1 and 2 are sampled for r1 alone: narrower results, padded); r2 wants none.
    argmax = [3, 2, 4]
    logits = [_peaked(argmax) + torch.linspace(0, 0.5, V) for _ in range(3)]
    params = [SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=0.0, logprobs=1),
              SamplingParams(temperature=0.0)]
    drafts = [[1, 2], [3, 2], [3, 1]]
    result, _ = _run(params, logits, drafts)
    assert result.sampled == [[3], [3, 2, 4], [3, 2]]
    lp = result.logprobs
    assert lp is not None
    flat = [t for s in result.sampled for t in s]
    assert lp.token_ids.shape == (len(flat), 6) and lp.logprobs.shape == (len(flat), 6)
    assert lp.ranks.shape == (len(flat),)
    assert lp.token_ids[:, 0].tolist() == flat  # r2's rows are there, unread
    # (request, position, columns filled): a position's result is as wide as its widest
    # alive row asks (as without drafts); r1's positions 1 and 2 ran alone (1 + 1 columns).
    for row, (req, pos, width) in enumerate([(0, 0, 6), (1, 0, 6), (1, 1, 2), (1, 2, 2)]):
        want = logits[req][pos].log_softmax(-1)
        assert lp.logprobs[row, 0] == pytest.approx(float(want[flat[row]]), abs=1e-5)
        top = want.topk(width - 1).indices.tolist()
        assert lp.token_ids[row, 1:width].tolist() == top
        assert lp.ranks[row] == 1
        if width < 6:
            assert not lp.token_ids[row, width:].any() and not lp.logprobs[row, width:].any()


# -- seeds -------------------------------------------------------------------------------------


def _reference(seed: int, logits: torch.Tensor, params: SamplingParams) -> list[int]:
    """The plain sampler once per position, each draw appended to the history."""
    table = _table([params])
    sampler = Sampler()
    out = []
    for j in range(len(logits)):
        meta = build_sampling_metadata(table, np.array([0]), V, CPU)
        token = int(sampler.forward(logits[j:j + 1].clone(), meta).token_ids[0])
        table.append_token(0, token)
        out.append(token)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_a_seeded_request_emits_what_the_plain_sampler_draws(seed: int) -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(100 + seed))
    params = SamplingParams(temperature=1.0, seed=seed, presence_penalty=0.5)
    ref = _reference(seed, logits, params)
    # Drafts equal to the draws: all accepted, plus the bonus.
    got, _ = _run([params], [logits], [ref[:3]])
    assert got.sampled == [ref]
    # A wrong draft at position 1: the correction is the reference's draw there.
    wrong = [ref[0], (ref[1] + 1) % V, ref[2]]
    got, _ = _run([params], [logits], [wrong])
    assert got.sampled == [ref[:2]]
    # Speculation spread over steps: 1 then 2 positions, the generator carried between them.
    table = _table([params])
    first, _ = _run([params], [logits[:2]], [[ref[0]]], table=table)
    second, _ = _run([params], [logits[2:]], [[ref[2]]], table=table)
    assert first.sampled[0] + second.sampled[0] == ref


def test_the_mask_is_applied_at_every_position_to_the_rows_still_running() -> None:
    """Structured outputs: the grammar's row for draft position j masks position j."""
    logits = [_peaked([3, 2, 4]) + torch.linspace(0, 0.5, V) for _ in range(3)]
    calls: list[tuple[list[int], int]] = []

    def mask(rows: torch.Tensor, requests: list[int], position: int) -> None:
        calls.append((list(requests), position))
        for r, i in enumerate(requests):
            if i == 0 and position == 1:
                rows[r, 2] = float("-inf")  # request 0's grammar forbids 2 after 3

    table = _table([SamplingParams(temperature=0.0)] * 3)
    logits_at, rows = _layout(logits)
    result = sample_with_drafts(logits_at, rows, [[3, 2], [3, 2], [1, 2]], np.arange(3),
                                table, Sampler(), V, CPU, mask)
    # Request 0: the forbidden draft is rejected and the best allowed token (5) emitted.
    assert result.sampled == [[3, 5], [3, 2, 4], [3]]
    assert calls == [([0, 1, 2], 0), ([0, 1], 1), ([1], 2)]
