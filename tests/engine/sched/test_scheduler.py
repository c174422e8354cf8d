"""Scheduler: budgets, chunking, mixing, stop conditions, aborts, preemption, priority,
bad input and stats (the scenarios of vLLM's tests/v1/core/test_scheduler.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
from sched_fakes import EOS, Driver, check_no_leaks, default_sampler, make_request, make_scheduler

from ringserve.engine.sched.request import RequestStatus
from ringserve.engine.wire import EngineCoreEventType, FinishReason
from ringserve.gpu.wire import Logprobs, ModelRunnerOutput


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    yield from check_no_leaks()


def test_schedule_new_requests_full_data_then_diffs() -> None:
    sched = make_scheduler()
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 20, max_tokens=2))
    d = Driver(sched)
    so = d.step()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["r0", "r1", "r2"]
    assert so.num_scheduled_tokens == {"r0": 20, "r1": 20, "r2": 20}
    assert so.total_num_scheduled_tokens == 60
    new = so.scheduled_new_reqs[0]
    assert len(new.block_ids) == 2 and new.num_computed_tokens == 0
    assert new.prompt_token_ids == sched.requests["r0"].prompt_token_ids
    so = d.step()
    assert so.scheduled_new_reqs == []
    assert [(c.req_id, c.num_computed_tokens, c.new_block_ids) for c in so.scheduled_cached_reqs] == [
        ("r0", 20, []),
        ("r1", 20, []),
        ("r2", 20, []),
    ]
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 1, "r2": 1}
    d.run()
    assert all(d.reason(f"r{i}") == FinishReason.LENGTH for i in range(3))
    assert d.tokens["r0"] == [default_sampler("r0", 0), default_sampler("r0", 1)]
    # The last step told the worker to drop the finished requests.
    assert d.worker.reqs == {} and not sched.has_requests()


def test_max_num_seqs_limits_running() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 8, max_tokens=3))
    d = Driver(sched)
    so = d.step()
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert sched.get_request_counts() == (2, 1)
    d.run()
    assert len(d.finished) == 3


def test_token_budget_and_chunked_prefill() -> None:
    sched = make_scheduler(max_num_batched_tokens=100)
    sched.add_request(make_request("a", 60, max_tokens=3))
    sched.add_request(make_request("b", 60, max_tokens=3))
    d = Driver(sched)
    so = d.step()
    assert so.num_scheduled_tokens == {"a": 60, "b": 40}
    so = d.step()
    # Decode of a and the rest of b's prompt in one batch.
    assert so.num_scheduled_tokens == {"a": 1, "b": 20}
    d.run()
    assert d.reason("a") == d.reason("b") == FinishReason.LENGTH


def test_no_chunking_waits_for_whole_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=100, enable_chunked_prefill=False, max_model_len=100)
    sched.add_request(make_request("a", 60, max_tokens=3))
    sched.add_request(make_request("b", 60, max_tokens=3))
    d = Driver(sched)
    so = d.step()
    assert so.num_scheduled_tokens == {"a": 60}
    so = d.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 60}
    d.run()


def test_long_prefill_threshold_caps_chunks() -> None:
    sched = make_scheduler(long_prefill_token_threshold=16)
    sched.add_request(make_request("a", 40, max_tokens=1))
    sched.add_request(make_request("b", 10, max_tokens=1))
    d = Driver(sched)
    assert d.step().num_scheduled_tokens == {"a": 16, "b": 10}
    assert d.step().num_scheduled_tokens == {"a": 16}
    assert d.step().num_scheduled_tokens == {"a": 8}
    d.run()
    assert d.reason("a") == FinishReason.LENGTH


def test_chunked_prefill_samples_only_at_the_end() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", 40, max_tokens=2))
    d = Driver(sched)
    for _ in range(2):
        d.step()
        assert "a" not in d.tokens
    d.step()
    assert d.tokens["a"] == [default_sampler("a", 0)]
    d.run()


# -- stop conditions ---------------------------------------------------------------------------


def sampler_with(overrides: dict[tuple[str, int], int]):  # type: ignore[no-untyped-def]
    def sample(rid: str, index: int) -> int:
        return overrides.get((rid, index), default_sampler(rid, index))

    return sample


def test_eos_stops_and_is_reported() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=10))
    d = Driver(sched, sampler=sampler_with({("a", 2): EOS}))
    d.run()
    out = d.finished["a"]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason is None
    assert d.tokens["a"][-1] == EOS and len(d.tokens["a"]) == 3


def test_ignore_eos_runs_to_max_tokens() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=6, ignore_eos=True))
    d = Driver(sched, sampler=sampler_with({("a", 2): EOS}))
    d.run()
    assert d.reason("a") == FinishReason.LENGTH and len(d.tokens["a"]) == 6


def test_stop_token_ids_set_stop_reason() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=10, stop_token_ids=[77]))
    d = Driver(sched, sampler=sampler_with({("a", 3): 77}))
    d.run()
    out = d.finished["a"]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == 77
    assert len(d.tokens["a"]) == 4


def test_min_tokens_suppresses_stops() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=10, min_tokens=3, stop_token_ids=[77]))
    d = Driver(sched, sampler=sampler_with({("a", 0): EOS, ("a", 1): 77, ("a", 2): 77}))
    d.run()
    assert d.finished["a"].stop_reason == 77 and len(d.tokens["a"]) == 3


def test_max_tokens_length() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=4))
    d = Driver(sched)
    d.run()
    assert d.reason("a") == FinishReason.LENGTH and len(d.tokens["a"]) == 4


def test_stop_wins_over_length_on_the_same_token() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=3))
    d = Driver(sched, sampler=sampler_with({("a", 2): EOS}))
    d.run()
    assert d.reason("a") == FinishReason.STOP


def test_max_model_len_caps_output() -> None:
    sched = make_scheduler(max_model_len=32)
    sched.add_request(make_request("a", 20, max_tokens=None))
    sched.add_request(make_request("b", 20, max_tokens=100))
    d = Driver(sched)
    d.run()
    assert d.reason("a") == d.reason("b") == FinishReason.LENGTH
    assert len(d.tokens["a"]) == len(d.tokens["b"]) == 12


# -- aborts ------------------------------------------------------------------------------------


def test_abort_waiting_and_running() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", 20, max_tokens=50))
    sched.add_request(make_request("wait", 20, max_tokens=50))
    d = Driver(sched)
    d.step()
    d.step()
    pool = sched.kv_cache_manager.block_pool
    assert pool.num_free_blocks < pool.num_usable_blocks
    sched.finish_requests(["wait", "run", "unknown"])
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert not sched.has_unfinished_requests() and sched.has_finished_requests()
    so = sched.schedule()
    assert so.finished_req_ids == ["run"]  # the worker never saw "wait"
    assert so.num_scheduled_tokens == {}
    assert "run" not in d.finished  # aborts asked for by the frontend produce no output


def test_abort_with_notify_and_abort_all() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 20, client_index=0))
    sched.add_request(make_request("b", 20, client_index=1))
    sched.add_request(make_request("c", 20, client_index=1))
    d = Driver(sched)
    d.step()
    sched.finish_requests("a", notify=True)
    outs = sched.take_pending_outputs()
    assert [o.finish_reason for o in outs[0].outputs] == [FinishReason.ABORT]
    assert outs[0].finished_requests == ["a"]
    outs = sched.abort_all(FinishReason.ERROR)
    assert {o.request_id: o.finish_reason for o in outs[1].outputs} == {
        "b": FinishReason.ERROR,
        "c": FinishReason.ERROR,
    }
    assert not sched.has_unfinished_requests()
    d.flush()
    sched.schedule()


# -- preemption --------------------------------------------------------------------------------


def test_preemption_by_recompute_newest_first_and_resume() -> None:
    # 6 usable blocks of 4 tokens; two requests of 8 prompt tokens that each grow to 16.
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=64)
    sched.add_request(make_request("old", 8, max_tokens=9, arrival_time=1.0))
    sched.add_request(make_request("new", 8, max_tokens=9, arrival_time=2.0))
    d = Driver(sched)
    preempted_at = None
    for _ in range(12):
        so = d.step()
        if so.preempted_req_ids:
            preempted_at = so
            break
    assert preempted_at is not None and preempted_at.preempted_req_ids == ["new"]
    assert "new" not in preempted_at.num_scheduled_tokens
    assert sched.requests["new"].status == RequestStatus.PREEMPTED
    assert next(iter(sched.waiting)).request_id == "new"
    resumed = None
    while resumed is None:
        so = d.step()
        resumed = next((c for c in so.scheduled_cached_reqs if c.resumed_from_preemption), None)
    assert resumed.req_id == "new"
    assert resumed.all_token_ids[:8] == sched.requests["new"].prompt_token_ids
    d.run()
    for rid in ("old", "new"):
        assert d.tokens[rid] == [default_sampler(rid, i) for i in range(9)]
    assert d.num_preemptions >= 1


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=64)
    sched.add_request(make_request("a", 7, max_tokens=8))
    sched.add_request(make_request("b", 7, max_tokens=8))
    d = Driver(sched)
    d.step()
    sched.add_request(make_request("c", 1, max_tokens=1))
    while True:
        so = d.step()
        if so.preempted_req_ids:
            assert so.scheduled_new_reqs == []
            break
    d.run()
    assert len(d.finished) == 3


def test_priority_policy_orders_waiting_and_picks_victim() -> None:
    sched = make_scheduler(policy="priority", max_num_seqs=2)
    sched.add_request(make_request("low", 8, priority=5, arrival_time=1.0))
    sched.add_request(make_request("high", 8, priority=0, arrival_time=2.0))
    sched.add_request(make_request("mid", 8, priority=1, arrival_time=3.0))
    d = Driver(sched)
    so = d.step()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["high", "mid"]
    d.run()
    assert len(d.finished) == 3

    sched2 = make_scheduler(policy="priority", num_blocks=7, block_size=4, max_model_len=64)
    sched2.add_request(make_request("hi", 8, max_tokens=9, priority=0, arrival_time=2.0))
    sched2.add_request(make_request("lo", 8, max_tokens=9, priority=3, arrival_time=1.0))
    d2 = Driver(sched2)
    while True:
        so = d2.step()
        if so.preempted_req_ids:
            assert so.preempted_req_ids == ["lo"]
            break
    d2.run()
    assert d2.tokens["lo"] == [default_sampler("lo", i) for i in range(9)]


def test_priority_victim_scheduled_earlier_in_step_is_unscheduled() -> None:
    # "lo" runs first (earlier arrival); when "hi" needs a block, "lo" (already scheduled
    # this step) is the victim: its tokens go back to the budget and it leaves the batch.
    sched = make_scheduler(policy="priority", num_blocks=5, block_size=4, max_model_len=64)
    sched.add_request(make_request("lo", 4, max_tokens=12, priority=9, arrival_time=1.0))
    d = Driver(sched)
    d.step()
    sched.add_request(make_request("hi", 6, max_tokens=12, priority=0, arrival_time=2.0))
    seen = False
    while sched.has_requests():
        so = d.step()
        if so.preempted_req_ids == ["lo"] and not seen:
            seen = True
            assert "lo" not in so.num_scheduled_tokens
            assert all(c.req_id != "lo" for c in so.scheduled_cached_reqs)
    assert seen
    assert d.tokens["lo"] == [default_sampler("lo", i) for i in range(12)]


# -- bad input ---------------------------------------------------------------------------------


def test_prompt_too_long_is_rejected_alone() -> None:
    sched = make_scheduler(max_model_len=32)
    sched.add_request(make_request("ok1", 5, max_tokens=2))
    sched.add_request(make_request("long", 32))
    sched.add_request(make_request("ok2", 5, max_tokens=2))
    with pytest.raises(ValueError, match="max_model_len is 32"):
        sched.check_request(make_request("long", 32))
    d = Driver(sched)
    d.run()
    out = d.finished["long"]
    assert out.finish_reason == FinishReason.ERROR and "max_model_len is 32" in str(out.stop_reason)
    assert d.reason("ok1") == d.reason("ok2") == FinishReason.LENGTH


def test_prompt_larger_than_cache_and_empty_prompt() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4)
    with pytest.raises(ValueError, match="whole KV cache holds 4 blocks"):
        sched.check_request(make_request("big", 17))
    sched.check_request(make_request("fits", 16))
    sched.add_request(make_request("big", 17))
    sched.add_request(make_request("empty", []))
    sched.add_request(make_request("ok", 4, max_tokens=1))
    d = Driver(sched)
    d.run()
    assert d.reason("big") == d.reason("empty") == FinishReason.ERROR
    assert d.reason("ok") == FinishReason.LENGTH


def test_request_outgrowing_the_whole_cache_ends_with_error() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    sched.add_request(make_request("grow", 8, max_tokens=50))
    sched.add_request(make_request("next", 4, max_tokens=2))
    d = Driver(sched)
    d.run()
    out = d.finished["grow"]
    assert out.finish_reason == FinishReason.ERROR and "whole cache" in str(out.stop_reason)
    assert len(d.tokens["grow"]) == 5  # 12 slots: 8 prompt + 4 computed outputs + 1 sampled
    assert d.reason("next") == FinishReason.LENGTH


def test_duplicate_request_id_is_refused() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="already in flight"):
        sched.add_request(make_request("a", 4))
    sched.finish_requests("a")


# -- outputs, stats, events --------------------------------------------------------------------


def test_outputs_grouped_by_client_with_stats_and_events() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=2, client_index=0))
    sched.add_request(make_request("b", 4, max_tokens=2, client_index=3))
    d = Driver(sched)
    so = sched.schedule()
    outs = sched.update_from_output(so, d.worker.execute(so))
    assert set(outs) == {0, 3}
    stats = outs[0].scheduler_stats
    assert stats is not None and stats.num_running_reqs == 2 and stats.kv_cache_usage > 0
    assert stats.prefix_cache_queries == 8 and stats.prefix_cache_hits == 0
    a = outs[0].outputs[0]
    assert a.events is not None
    assert [e.type for e in a.events] == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    d.collect(outs)
    d.run()
    assert d.finished["b"].finish_reason == FinishReason.LENGTH


def test_logprobs_rows_follow_each_request() -> None:
    sched = make_scheduler(log_stats=False)
    sched.add_request(make_request("plain", 4, max_tokens=1))
    sched.add_request(make_request("lp", 4, max_tokens=1, logprobs=2, prompt_logprobs=1))
    so = sched.schedule()
    rows = np.arange(6, dtype=np.int32).reshape(2, 3)
    prompt_lp = Logprobs(np.zeros((3, 2), np.int32), np.zeros((3, 2), np.float32), np.ones(3, np.int32))
    mro = ModelRunnerOutput(
        so.step_id,
        ["plain", "lp"],
        [[7], [8]],
        Logprobs(rows, rows.astype(np.float32), np.array([1, 2], np.int32)),
        {"lp": prompt_lp},
    )
    outs = sched.update_from_output(so, mro)[0].outputs
    by_id = {o.request_id: o for o in outs}
    assert by_id["plain"].new_logprobs is None
    got = by_id["lp"].new_logprobs
    assert got is not None and got.token_ids.tolist() == [[3, 4, 5]] and got.ranks.tolist() == [2]
    assert by_id["lp"].new_prompt_logprobs is prompt_lp
    assert outs[0].scheduler_stats if False else True
    sched.schedule()


def test_stats_deltas_and_reset_prefix_cache() -> None:
    sched = make_scheduler(block_size=4, log_stats=False)
    prompt = list(range(1000, 1013))
    d = Driver(sched)  # one worker: its simulated KV cache backs the prefix hits
    sched.add_request(make_request("a", prompt, max_tokens=1))
    d.run()
    first = sched.make_stats()
    assert (first.prefix_cache_queries, first.prefix_cache_hits) == (13, 0)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    d.run()
    second = sched.make_stats()
    assert (second.prefix_cache_queries, second.prefix_cache_hits) == (13, 12)
    assert sched.reset_prefix_cache()
    sched.add_request(make_request("c", prompt, max_tokens=1))
    d.run()
    assert sched.make_stats().prefix_cache_hits == 0


def test_worker_request_error_ends_only_that_request() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("bad", 8, max_tokens=4))
    sched.add_request(make_request("good", 8, max_tokens=4))
    so = sched.schedule()
    mro = ModelRunnerOutput(step_id=so.step_id, req_ids=["good"], sampled_token_ids=[[5]],
                            request_errors={"bad": "NaN logits"})
    outs = sched.update_from_output(so, mro)[0].outputs
    by_id = {o.request_id: o for o in outs}
    assert by_id["bad"].finish_reason is FinishReason.ERROR
    assert "NaN logits" in str(by_id["bad"].stop_reason)
    assert by_id["good"].finish_reason is None and by_id["good"].new_token_ids == [5]
    assert list(sched.requests) == ["good"]
    sched.finish_requests("good")


# -- one stop / length rule for one-token and multi-token steps --------------------------------


class StopCase(NamedTuple):
    sampling: dict[str, Any]
    max_model_len: int
    stream: list[int]  # what the worker samples
    kept: list[int]  # what the client gets
    reason: FinishReason
    stop_reason: int | None = None


STOP_CASES = [
    StopCase({}, 1024, [5, 6, EOS, 7], [5, 6, EOS], FinishReason.STOP),
    StopCase({"min_tokens": 4}, 1024, [5, EOS, 6, EOS, 9], [5, EOS, 6, EOS], FinishReason.STOP),
    StopCase({"stop_token_ids": [9]}, 1024, [5, 9, 6], [5, 9], FinishReason.STOP, 9),
    StopCase({"max_tokens": 3}, 1024, [5, 6, 7, 8], [5, 6, 7], FinishReason.LENGTH),
    StopCase({"max_tokens": 3, "stop_token_ids": [9]}, 1024, [5, 6, 9, 8], [5, 6, 9],
             FinishReason.STOP, 9),
    StopCase({"max_tokens": 2, "ignore_eos": True}, 1024, [EOS, EOS, EOS], [EOS, EOS],
             FinishReason.LENGTH),
    # max_model_len caps the output: a 10-token prompt in 14 leaves room for 4.
    StopCase({"max_tokens": None}, 14, [5, 6, 7, 8, 9], [5, 6, 7, 8], FinishReason.LENGTH),
]


def _feed(case: StopCase, chunk: int) -> tuple[list[int], FinishReason | None, int | None]:
    """Run one request on the case's stream, `chunk` sampled tokens per step."""
    sched = make_scheduler(max_model_len=case.max_model_len)
    sched.add_request(make_request("r", 10, **{"max_tokens": 16, **case.sampling}))
    so = sched.schedule()
    got: list[int] = []
    reason = stop_reason = None
    for start in range(0, len(case.stream), chunk):
        mro = ModelRunnerOutput(step_id=so.step_id, req_ids=["r"],
                                sampled_token_ids=[case.stream[start:start + chunk]])
        for batch in sched.update_from_output(so, mro).values():
            for out in batch.outputs:
                got += out.new_token_ids
                if out.finish_reason is not None:
                    reason = out.finish_reason
                    stop_reason = out.stop_reason if isinstance(out.stop_reason, int) else None
    assert not sched.requests  # every case ends the request
    return got, reason, stop_reason


@pytest.mark.parametrize("case", STOP_CASES)
def test_one_token_and_multi_token_steps_stop_alike(case: StopCase) -> None:
    for chunk in (1, 2, len(case.stream)):
        assert _feed(case, chunk) == (case.kept, case.reason, case.stop_reason), f"chunk={chunk}"
