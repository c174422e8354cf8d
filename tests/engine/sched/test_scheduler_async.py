"""Async scheduling books: step N+1 scheduled before step N's tokens arrive (placeholders),
stale outputs of finished, aborted or preempted requests discarded (vLLM's
test_async_scheduler.py scenarios)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sched_fakes import EOS, Driver, check_no_leaks, default_sampler, make_request, make_scheduler

from ringserve.engine.wire import FinishReason


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    yield from check_no_leaks()


def sampler_with(overrides: dict[tuple[str, int], int]):  # type: ignore[no-untyped-def]
    def sample(rid: str, index: int) -> int:
        return overrides.get((rid, index), default_sampler(rid, index))

    return sample


def test_placeholders_let_the_next_step_be_scheduled() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 10, max_tokens=5))
    d = Driver(sched, async_scheduling=True)
    so1 = d.step()
    req = sched.requests["a"]
    assert so1.num_scheduled_tokens == {"a": 10}
    assert (req.num_computed_tokens, req.num_output_placeholders) == (10, 1)
    so2 = d.step()  # scheduled before step 1's token is applied, then step 1 applied
    assert so2.num_scheduled_tokens == {"a": 1}
    assert so2.scheduled_cached_reqs[0].num_computed_tokens == 10
    assert (req.num_computed_tokens, req.num_output_placeholders, req.num_output_tokens) == (11, 1, 1)
    d.run()
    assert d.tokens["a"] == [default_sampler("a", i) for i in range(5)]
    assert d.reason("a") == FinishReason.LENGTH


def test_no_step_past_max_tokens() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=2))
    d = Driver(sched, async_scheduling=True)
    d.step()  # prefill, placeholder 1
    d.step()  # decode (placeholder 2), prefill's token applied
    so = d.step()  # both pending outputs reach max_tokens: nothing to schedule
    assert so.num_scheduled_tokens == {}
    d.run()
    assert len(d.tokens["a"]) == 2


def test_eos_while_next_step_in_flight_discards_its_output() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=10))
    sched.add_request(make_request("b", 4, max_tokens=10))
    d = Driver(sched, async_scheduling=True, sampler=sampler_with({("a", 1): EOS}))
    d.run()
    assert d.reason("a") == FinishReason.STOP and d.tokens["a"] == [default_sampler("a", 0), EOS]
    assert d.tokens["b"] == [default_sampler("b", i) for i in range(10)]


def test_abort_while_in_flight() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=10))
    sched.add_request(make_request("b", 4, max_tokens=10))
    d = Driver(sched, async_scheduling=True)
    d.step()
    d.step()
    sched.finish_requests("a")  # its step is still in flight
    d.run()
    assert "a" not in d.finished and len(d.tokens["a"]) == 1
    assert d.reason("b") == FinishReason.LENGTH


def test_preempted_while_in_flight_discards_stale_tokens() -> None:
    sched = make_scheduler(num_blocks=7, block_size=4, max_model_len=64)
    sched.add_request(make_request("old", 8, max_tokens=12, arrival_time=1.0))
    sched.add_request(make_request("new", 8, max_tokens=12, arrival_time=2.0))
    d = Driver(sched, async_scheduling=True)
    preempted = False
    while sched.has_requests() or d.in_flight:
        if not sched.has_requests():
            d.flush()
            break
        so = d.step()
        preempted |= bool(so.preempted_req_ids)
    assert preempted
    for rid in ("old", "new"):
        assert d.tokens[rid] == [default_sampler(rid, i) for i in range(12)]


@pytest.mark.parametrize("caching", [True, False])
def test_async_and_sync_give_the_same_outputs(caching: bool) -> None:
    def workload(async_scheduling: bool) -> dict[str, list[int]]:
        sched = make_scheduler(
            num_blocks=20, block_size=4, max_num_batched_tokens=24, enable_prefix_caching=caching
        )
        shared = list(range(500, 512))
        for i in range(6):
            sched.add_request(make_request(f"r{i}", shared + [i] * (i + 1), max_tokens=6 + i))
        d = Driver(sched, async_scheduling=async_scheduling, sampler=sampler_with({("r2", 3): EOS}))
        d.run()
        return d.tokens

    assert workload(True) == workload(False)
