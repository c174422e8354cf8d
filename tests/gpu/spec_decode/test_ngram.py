"""Prompt-lookup drafts (`propose_ngram`, `NgramProposer`): the longest suffix first, its
latest earlier occurrence, at most `k` tokens, and nothing when nothing matches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringserve.gpu.runner.request_state import RequestTable
from ringserve.gpu.spec_decode.ngram import NgramProposer, propose_ngram
from ringserve.gpu.wire import NewRequestData
from ringserve.sampling_params import SamplingParams


def _propose(tokens: list[int], min_n: int = 1, max_n: int = 3, k: int = 4) -> list[int]:
    return propose_ngram(np.asarray(tokens, dtype=np.int32), min_n, max_n, k)


def test_longest_suffix_first() -> None:
    # Suffix [1, 2, 3] occurs at 0 (followed by 9 5); the 1-token suffix [3] last occurred
    # at 5 (followed by 7).
    tokens = [1, 2, 3, 9, 5, 3, 7, 1, 2, 3]
    assert _propose(tokens, max_n=3) == [9, 5, 3, 7]
    assert _propose(tokens, max_n=1) == [7, 1, 2, 3]
    # With the longest suffix unmatched, the next shorter one is tried.
    tokens = [8, 2, 3, 6, 1, 2, 3]  # [1, 2, 3] never earlier; [2, 3] at 1
    assert _propose(tokens, max_n=3) == [6, 1, 2, 3]


def test_the_latest_earlier_occurrence_wins() -> None:
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]
    assert _propose(tokens, min_n=2, max_n=2) == [8, 1, 2]


def test_no_match_gives_nothing() -> None:
    assert _propose([1, 2, 3, 4, 5]) == []
    assert _propose([5, 1, 2, 3, 4], min_n=2, max_n=3) == []  # 4 never before
    # The last token occurs earlier, but no suffix of min_n tokens does.
    assert _propose([4, 1, 2, 5, 4], min_n=2, max_n=3) == []


def test_k_caps_the_drafts() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert _propose(tokens, min_n=2, k=3) == [3, 4, 5]
    assert _propose(tokens, min_n=2, k=1) == [3]


def test_a_match_near_the_end_gives_fewer_than_k() -> None:
    # [5, 6] occurred at 2: only the suffix itself follows it.
    assert _propose([1, 9, 5, 6, 5, 6], min_n=2, k=5) == [5, 6]
    # An overlapping match: [7, 7] at 1 is followed by the last 7 alone.
    assert _propose([3, 7, 7, 7], min_n=2, max_n=2, k=4) == [7]


def test_the_suffix_itself_is_not_a_match() -> None:
    # The suffix occurs only at the end: no drafts (not "the tokens after the end").
    assert _propose([1, 2, 3], min_n=1, max_n=3) == []
    assert _propose([4, 5], min_n=2, max_n=2) == []


@pytest.mark.parametrize("tokens", [[], [1], [1, 1], [1, 2, 1]])
def test_min_n_longer_than_the_sequence_allows_gives_nothing(tokens: list[int]) -> None:
    assert _propose(tokens, min_n=3, max_n=5) == []


def test_max_n_longer_than_the_sequence_is_capped() -> None:
    assert _propose([4, 4], min_n=1, max_n=8) == [4]


def test_the_proposer_reads_each_request_from_the_table() -> None:
    table = RequestTable(max_num_reqs=4, max_model_len=32, block_size=4, eos_token_ids=(0,),
                         device=torch.device("cpu"))
    rows = {"a": [1, 2, 3, 4, 1, 2], "b": [5, 6, 7], "c": [8, 9, 8, 9]}
    for rid, tokens in rows.items():
        table.apply_new(NewRequestData(rid, tokens[:2], SamplingParams(), [1], 0, tokens[2:]))
    slots = np.array([table.slot_of(r) for r in rows], dtype=np.int64)
    proposer = NgramProposer(min_n=2, max_n=3)
    got = proposer.propose(table, list(rows), slots, [2, 2, 0])
    # a: [1, 2] at 0 -> 3 4; b: no match (absent); c: asked for none.
    assert got == {"a": [3, 4]}
