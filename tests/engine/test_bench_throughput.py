"""`ringserve bench throughput`: the per-request token-count check and what is credited."""

from __future__ import annotations

from ringserve.bench.throughput import check_counts, workload


def test_exact_counts_are_credited_in_full() -> None:
    credited, problems = check_counts("e", [3, 5, 7], [3, 5, 7])
    assert (credited, problems) == (15, [])


def test_short_or_long_requests_are_reported_and_only_generated_tokens_count() -> None:
    credited, problems = check_counts("hf", [3, 4, 9], [3, 5, 7])
    assert credited == 3 + 4 + 7
    assert problems == ["request 1: asked for 5, hf generated 4",
                        "request 2: asked for 7, hf generated 9"]


def test_padded_batch_may_overrun_but_not_fall_short() -> None:
    credited, problems = check_counts("padded", [7, 7, 7], [3, 5, 7], at_least=True)
    assert (credited, problems) == (15, [])
    credited, problems = check_counts("padded", [4, 4, 4], [3, 5, 7], at_least=True)
    assert credited == 3 + 4 + 4 and len(problems) == 2


def test_missing_results_are_reported() -> None:
    _, problems = check_counts("e", [3], [3, 5])
    assert problems == ["e returned 1 results for 2 requests"]


def test_workload_is_fixed() -> None:
    prompts, outs = workload()
    assert len(prompts) == len(outs) == 32 and sum(outs) == 4932
