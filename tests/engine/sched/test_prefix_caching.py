"""Prefix caching through the scheduler: hits, the num_tokens - 1 cap, eviction order, salt
isolation, decode blocks, prompt logprobs, reset (vLLM's test_prefix_caching.py scenarios).
The fake worker checks that every hit block holds the right tokens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sched_fakes import Driver, check_no_leaks, default_sampler, make_request, make_scheduler

from ringserve.engine.sched.block_hash import ROOT_HASH, hash_full_blocks
from ringserve.engine.wire import FinishReason


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    yield from check_no_leaks()


PROMPT = list(range(3000, 3040))  # 2.5 blocks of 16


def test_common_prefix_hits_full_blocks() -> None:
    sched = make_scheduler()
    d = Driver(sched)
    sched.add_request(make_request("a", PROMPT, max_tokens=3))
    d.step()
    sched.add_request(make_request("b", [*PROMPT[:32], 1, 2, 3], max_tokens=3))
    so = d.step()
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 32 and so.num_scheduled_tokens["b"] == 3
    a_blocks = sched.kv_cache_manager.get_block_ids("a")
    assert new.block_ids[:2] == a_blocks[:2]
    assert sched.kv_cache_manager.block_pool.ref_cnt[a_blocks[0]] == 2
    d.run()
    assert d.finished["b"].num_cached_tokens == 32
    assert (d.prefix_queries, d.prefix_hits) == (40 + 35, 32)


def test_same_step_admission_shares_blocks() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", PROMPT, max_tokens=2))
    sched.add_request(make_request("b", PROMPT, max_tokens=2))
    d = Driver(sched)
    so = d.step()
    assert so.num_scheduled_tokens == {"a": 40, "b": 8}
    d.run()
    assert d.tokens["b"] == [default_sampler("b", i) for i in range(2)]


def test_hit_capped_so_last_token_is_computed() -> None:
    sched = make_scheduler()
    d = Driver(sched)
    sched.add_request(make_request("a", PROMPT[:32], max_tokens=1))
    d.run()
    sched.add_request(make_request("b", PROMPT[:32], max_tokens=1))
    so = d.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert so.num_scheduled_tokens == {"b": 16}
    d.run()


def test_eviction_order_tail_first_lru() -> None:
    # 8 usable blocks of 4 tokens; a and b each hold 2 full (cached) blocks + 1 partial.
    sched = make_scheduler(num_blocks=9, block_size=4)
    pool = sched.kv_cache_manager.block_pool
    d = Driver(sched)
    a = list(range(100, 108))
    b = list(range(200, 208))
    sched.add_request(make_request("a", [*a, 1], max_tokens=1))
    d.run()
    sched.add_request(make_request("b", [*b, 1], max_tokens=1))
    d.run()
    a0, a1 = hash_full_blocks(ROOT_HASH, a, 4)
    b0, b1 = hash_full_blocks(ROOT_HASH, b, 4)
    assert all(pool.get_cached_block(h) is not None for h in (a0, a1, b0, b1))
    # 4 new blocks: the 2 never-used ones, then a's partial tail, then a's last full block.
    sched.add_request(make_request("c", list(range(300, 313)), max_tokens=1))
    d.step()
    assert pool.get_cached_block(a1) is None  # a was freed first, tail first
    assert pool.get_cached_block(a0) is not None
    assert pool.get_cached_block(b0) is not None and pool.get_cached_block(b1) is not None
    d.run()
    sched.add_request(make_request("a2", [*a, 9], max_tokens=1))
    so = d.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4
    d.run()


def test_salt_isolates_prefixes() -> None:
    sched = make_scheduler()
    d = Driver(sched)
    sched.add_request(make_request("plain", PROMPT, max_tokens=1))
    d.run()
    sched.add_request(make_request("salted", PROMPT, max_tokens=1, cache_salt="alice"))
    so = d.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    d.run()
    sched.add_request(make_request("salted2", PROMPT, max_tokens=1, cache_salt="alice"))
    sched.add_request(make_request("other", PROMPT, max_tokens=1, cache_salt="bob"))
    so = d.step()
    assert {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs} == {"salted2": 32, "other": 0}
    d.run()


def test_decoded_blocks_are_cached_for_follow_up_turns() -> None:
    sched = make_scheduler(block_size=4)
    d = Driver(sched)
    sched.add_request(make_request("t1", PROMPT[:6], max_tokens=10))
    d.run()
    history = PROMPT[:6] + d.tokens["t1"]
    req_hashes = hash_full_blocks(ROOT_HASH, history, 4)
    assert all(sched.kv_cache_manager.block_pool.get_cached_block(h) is not None for h in req_hashes[:3])
    sched.add_request(make_request("t2", [*history, 7, 7], max_tokens=1))
    so = d.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12  # 15 known tokens fill 3 blocks
    d.run()


def test_prompt_logprobs_request_skips_cache_read() -> None:
    sched = make_scheduler()
    d = Driver(sched)
    sched.add_request(make_request("a", PROMPT, max_tokens=1))
    d.run()
    sched.add_request(make_request("b", PROMPT, max_tokens=1, prompt_logprobs=0))
    so = d.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    d.run()


def test_prefix_caching_off_never_hits() -> None:
    sched = make_scheduler(enable_prefix_caching=False)
    d = Driver(sched)
    sched.add_request(make_request("a", PROMPT, max_tokens=1))
    d.run()
    sched.add_request(make_request("b", PROMPT, max_tokens=1))
    so = d.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert sched.kv_cache_manager.block_pool.num_cached_blocks == 0
    d.run()


def test_reset_prefix_cache_with_requests_running() -> None:
    sched = make_scheduler()
    d = Driver(sched)
    sched.add_request(make_request("a", PROMPT, max_tokens=30))
    d.step()
    assert sched.reset_prefix_cache()
    sched.add_request(make_request("b", PROMPT, max_tokens=1))
    so = d.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    d.run()
    assert len(d.tokens["a"]) == 30


def test_victim_scheduled_earlier_in_the_step_leaves_no_cached_garbage() -> None:
    """Regression (found by the random workloads): a running request scheduled first in a
    step, then preempted in the same step, must not leave its not-yet-written blocks in the
    prefix cache; resumed, it would hit them and skip computing those positions."""
    sched = make_scheduler(num_blocks=9, block_size=4, max_num_seqs=2, max_num_batched_tokens=21,
                           max_model_len=22, enable_chunked_prefill=False,
                           long_prefill_token_threshold=3, policy="priority",
                           enable_prefix_caching=True)
    d = Driver(sched)
    sched.add_request(make_request("r0", [11, 12, 13, 14, 15, 16, 17, 18, 19, 20] + [10] * 11,
                                   max_tokens=1, priority=1, arrival_time=1.0))
    d.step()
    d.step()
    sched.add_request(make_request("r1", [21, 22, 23, 24, 25, 26, 10], max_tokens=3, priority=0,
                                   arrival_time=2.0))
    preempted = []
    for _ in range(40):  # the fake worker asserts every position it reads was written
        so = d.step()
        preempted += so.preempted_req_ids
        if not sched.has_requests():
            break
    assert preempted == ["r0"]
    assert d.finished["r0"].finish_reason == FinishReason.LENGTH
    assert d.finished["r1"].finish_reason == FinishReason.LENGTH
