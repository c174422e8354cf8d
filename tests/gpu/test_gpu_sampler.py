"""The sampler on hand-made logits: greedy, truncation, seeds, penalties, logit edits, logprobs
and NaN rows, with metadata built through the real request table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringserve.gpu.runner.request_state import RequestTable
from ringserve.gpu.sample.sampler import Sampler, SamplerOutput
from ringserve.gpu.sample.sampling_metadata import build_sampling_metadata
from ringserve.gpu.wire import NewRequestData
from ringserve.sampling_params import SamplingParams

VOCAB = 32
EOS = 1


def _run(
    params: list[SamplingParams],
    logits: torch.Tensor,
    prompt: list[int] | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplerOutput:
    table = RequestTable(
        max_num_reqs=8, max_model_len=64, block_size=4, eos_token_ids=(EOS,),
        device=torch.device("cpu"), tokenize=lambda w: [[int(t) for t in w.split()]],
    )
    for i, p in enumerate(params):
        out = outputs[i] if outputs else []
        table.apply_new(NewRequestData(f"r{i}", prompt or [2, 3], p, [0, 1], 0, out))
    slots = np.arange(len(params))
    meta = build_sampling_metadata(table, slots, VOCAB, torch.device("cpu"))
    return Sampler().forward(logits.clone(), meta)


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits(3)
    out = _run([SamplingParams(temperature=0.0)] * 3, logits)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None and not out.nan_rows.any()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0),
     SamplingParams(temperature=1e-3)],
)
def test_truncation_to_one_token_equals_greedy(params: SamplingParams) -> None:
    logits = _logits(4, seed=1)
    out = _run([params] * 4, logits)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_mixed_greedy_and_random_rows() -> None:
    logits = _logits(2, seed=2)
    out = _run([SamplingParams(temperature=0.0), SamplingParams(top_k=1)], logits)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_top_k_keeps_draws_inside_the_top_k() -> None:
    logits = torch.zeros(8, VOCAB)
    logits[:, :3] = 5.0
    out = _run([SamplingParams(top_k=3, seed=i) for i in range(8)], logits)
    assert set(out.token_ids.tolist()) <= {0, 1, 2}


def test_seeded_rows_repeat_and_unseeded_differ_between_seeds() -> None:
    logits = torch.zeros(1, VOCAB)
    first = [_run([SamplingParams(seed=7)], logits).token_ids[0] for _ in range(3)]
    assert len(set(first)) == 1
    draws = {int(_run([SamplingParams(seed=s)], logits).token_ids[0]) for s in range(20)}
    assert len(draws) > 5


def test_penalties_follow_vllm_formulas() -> None:
    logits = torch.full((1, VOCAB), 2.0)
    logits[0, 5] = -2.0
    params = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    table_out = _run([params], logits.clone(), prompt=[4, 5], outputs=[[6, 6]])
    from ringserve.gpu.sample.logits_processors import apply_penalties
    from ringserve.gpu.sample.sampling_metadata import Penalties

    p = Penalties(
        presence=torch.tensor([0.25]), frequency=torch.tensor([0.5]),
        repetition=torch.tensor([2.0]),
        prompt_mask=torch.zeros(1, VOCAB, dtype=torch.bool).index_fill_(1, torch.tensor([4, 5]), True),
        output_counts=torch.zeros(1, VOCAB).index_fill_(1, torch.tensor([6]), 2.0),
    )
    got = apply_penalties(logits.clone(), p)[0]
    assert got[4].item() == pytest.approx(1.0)  # 2 / 2 (prompt)
    assert got[5].item() == pytest.approx(-4.0)  # -2 * 2 (prompt, negative)
    assert got[6].item() == pytest.approx(1.0 - 1.0 - 0.25)  # 2/2 - 0.5*2 - 0.25
    assert got[7].item() == pytest.approx(2.0)
    assert table_out.token_ids[0] not in (4, 5, 6)


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 9] = 10.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]),
    ]
    out = _run(params, logits, outputs=[[3], [3, 4]])
    assert out.token_ids[0] not in (EOS, 9)
    assert out.token_ids[1] in (EOS, 9)


def test_logit_bias_allowed_ids_and_bad_words() -> None:
    logits = _logits(3, seed=3)
    params = [
        SamplingParams(temperature=0.0, logit_bias={17: 100.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[11, 12]),
        SamplingParams(temperature=0.0, bad_words=["8 9"]),
    ]
    logits[2, 9] = 50.0
    out = _run(params, logits, outputs=[[], [], [3, 8]])
    assert out.token_ids[0] == 17
    assert out.token_ids[1] in (11, 12)
    assert out.token_ids[2] != 9  # "8 9" is banned after an 8


def test_logprobs_are_raw_with_ranks() -> None:
    logits = _logits(2, seed=4)
    params = [SamplingParams(temperature=0.0, logprobs=3, logit_bias={0: 100.0}),
              SamplingParams(temperature=0.0, logprobs=1)]
    out = _run(params, logits)
    assert out.logprobs is not None
    ref = logits.log_softmax(-1)
    lp = out.logprobs
    assert lp.token_ids.shape == (2, 4) and lp.token_ids.dtype == np.int32
    assert lp.token_ids[0, 0] == 0  # sampled under the bias, logprob from the raw logits
    assert lp.logprobs[0, 0] == pytest.approx(ref[0, 0].item(), abs=1e-6)
    assert lp.ranks[0] == int((ref[0] >= ref[0, 0]).sum())
    np.testing.assert_allclose(lp.logprobs[:, 1:], ref.topk(3).values.numpy(), atol=1e-6)


def test_nan_row_is_flagged_alone() -> None:
    logits = _logits(3, seed=5)
    logits[1, 4] = float("nan")
    out = _run([SamplingParams(temperature=0.0)] * 3, logits)
    assert out.nan_rows.tolist() == [False, True, False]
    assert out.token_ids[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()


def test_plain_greedy_path_matches_the_general_path_and_breaks_ties_to_the_first_id() -> None:
    logits = _logits(5, seed=7)
    logits[2, [3, 9, 20]] = 100.0  # a three-way tie: the first id wins, as with argmax
    logits[4, 6] = float("nan")
    plain = _run([SamplingParams(temperature=0.0)] * 5, logits)
    # logprobs=0 takes the general path (NaN check, processors, argmax) on the same rows
    general = _run([SamplingParams(temperature=0.0, logprobs=0)] * 5, logits)
    assert plain.logprobs is None and general.logprobs is not None
    assert plain.nan_rows.tolist() == general.nan_rows.tolist() == [False] * 4 + [True]
    assert plain.token_ids[:4].tolist() == general.token_ids[:4].tolist()
    assert plain.token_ids[2] == 3
