"""The scheduler's side of speculative decoding (`SpecScheduling` behind `Scheduler.spec`),
stepped by hand with made-up `ModelRunnerOutput`s: a decode with drafts is scheduled
`1 + k` tokens within the budget, max_tokens and max_model_len; constrained requests get
none; the computed count rolls back over rejected drafts so that no unverified position
reaches the prefix cache; stops inside an accepted run; lookahead slots; the acceptance
counts; and `DraftController`'s "never slower" policy."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import sched_fakes
from sched_fakes import EOS, check_no_leaks, make_request

import ringserve.gpu.spec_decode.scheduling as scheduling
from ringserve.config import CacheConfig, SchedulerConfig
from ringserve.engine.sched.scheduler import Scheduler
from ringserve.engine.wire import EngineCoreOutputs, FinishReason, SpecDecodingStats
from ringserve.gpu.spec_decode.scheduling import (
    EXPLORE_EVERY,
    REVISIT_EVERY,
    DraftController,
    SpecScheduling,
)
from ringserve.gpu.wire import ModelRunnerOutput, SchedulerOutput
from ringserve.sampling_params import StructuredOutputsParams

BS = 4  # block size: drafts cross block boundaries in a few tokens


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    yield from check_no_leaks()


def _make(k: int = 3, lookahead: int = 0, *, pinned: tuple[tuple[int, int], ...] = (),
          max_num_batched_tokens: int = 64, max_model_len: int = 64,
          num_blocks: int = 64) -> Scheduler:
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len, async_scheduling=False),
        CacheConfig(block_size=BS, enable_prefix_caching=True),
        num_blocks,
        eos_token_ids=(EOS,),
        spec=SpecScheduling(k, lookahead, pinned),
    )
    sched_fakes._created_schedulers.append(sched)  # the end-of-test leak check
    return sched


def _apply(sched: Scheduler, so: SchedulerOutput, sampled: dict[str, list[int]],
           drafts: dict[str, list[int]] | None = None) -> dict[int, EngineCoreOutputs]:
    """The workers' answer to `so`: `sampled` per request, `drafts` for the next step."""
    ids = list(so.num_scheduled_tokens)
    return sched.update_from_output(so, ModelRunnerOutput(
        so.step_id, ids, [sampled.get(r, []) for r in ids], draft_token_ids=drafts or {}))


def _prefill(sched: Scheduler, drafts: dict[str, list[int]],
             first: dict[str, int] | None = None) -> None:
    """Admit and prefill everything waiting; each request samples one token (100 unless
    `first` says otherwise) and is proposed `drafts`."""
    so = sched.schedule()
    assert so.scheduled_new_reqs and not so.spec_token_ids
    _apply(sched, so, {r: [(first or {}).get(r, 100)] for r in so.num_scheduled_tokens}, drafts)


def _end(sched: Scheduler) -> None:
    sched.finish_requests(list(sched.requests))


def _stats(outs: dict[int, EngineCoreOutputs]) -> SpecDecodingStats | None:
    stats = outs[0].scheduler_stats
    assert stats is not None
    return stats.spec_decoding


# -- what a step verifies ----------------------------------------------------------------------


def test_a_decode_with_drafts_is_scheduled_one_plus_k_tokens() -> None:
    sched = _make(k=3)
    sched.add_request(make_request("a", 6, max_tokens=20))
    _prefill(sched, {"a": [101, 102, 103]})
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4} and so.total_num_scheduled_tokens == 4
    assert so.spec_token_ids == {"a": [101, 102, 103]}
    assert so.num_spec_tokens == 3  # batch 1 speculates from its first decode step
    (cached,) = so.scheduled_cached_reqs
    assert cached.num_computed_tokens == 6  # the last known token comes first
    _apply(sched, so, {"a": [101, 102, 103, 104]})
    # Drafts are one step's: with none proposed, the next step is a plain decode.
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 1} and so.spec_token_ids == {}
    _apply(sched, so, {"a": [105]})
    assert sched.requests["a"].all_token_ids[6:] == [100, 101, 102, 103, 104, 105]
    _end(sched)


@pytest.mark.parametrize("emitted", [1, 2, 3, 4])
def test_the_computed_count_rolls_back_over_rejected_drafts(emitted: int) -> None:
    sched = _make(k=3)
    sched.add_request(make_request("a", 6, max_tokens=20))
    _prefill(sched, {"a": [101, 102, 103]})
    so = sched.schedule()
    req = sched.requests["a"]
    assert req.num_computed_tokens == 6 + 4  # booked at scheduling time
    drafts = [101, 102, 103]
    tokens = [*drafts[:emitted - 1], 200]  # accepted drafts, then one more
    outs = _apply(sched, so, {"a": tokens}, {"a": [300, 301]})
    assert outs[0].outputs[0].new_token_ids == tokens
    num_out = 1 + emitted
    assert req.num_computed_tokens == 6 + num_out - 1
    assert req.num_output_placeholders == 0
    sched.check_invariants()
    # The next step starts exactly at the first position not verified.
    so = sched.schedule()
    assert so.scheduled_cached_reqs[0].num_computed_tokens == 6 + num_out - 1
    assert so.num_scheduled_tokens == {"a": 3} and so.spec_token_ids == {"a": [300, 301]}
    _apply(sched, so, {"a": [300, 7]})
    assert req.num_computed_tokens == req.num_tokens - 1
    _end(sched)


def test_the_invariants_hold_while_a_step_with_drafts_is_in_flight() -> None:
    sched = _make(k=3)
    sched.add_request(make_request("a", 6, max_tokens=20))
    _prefill(sched, {"a": [101, 102, 103]})
    so = sched.schedule()
    try:
        sched.check_invariants()  # what sched_fakes.Driver.step does at this point
    finally:
        _apply(sched, so, {"a": [1]})
        _end(sched)


def test_drafts_are_capped_by_the_token_budget() -> None:
    sched = _make(k=3, max_num_batched_tokens=6)
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, 2, max_tokens=20))
    _prefill(sched, {r: [101, 102, 103] for r in ("a", "b", "c")})
    so = sched.schedule()
    # a: 1 + 3 (budget 6 -> 2); b: 1 + 1 (-> 0); c: nothing left this step.
    assert so.num_scheduled_tokens == {"a": 4, "b": 2}
    assert so.spec_token_ids == {"a": [101, 102, 103], "b": [101]}
    assert so.total_num_scheduled_tokens == 6
    _apply(sched, so, {"a": [101, 9], "b": [101, 102]})
    assert sched.requests["b"].num_computed_tokens == sched.requests["b"].num_tokens - 1
    # c's drafts were for the step it missed; b's unused ones were not carried either.
    so = sched.schedule()
    assert so.spec_token_ids == {}
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    _apply(sched, so, {r: [5] for r in ("a", "b", "c")})
    _end(sched)


def test_a_budget_of_one_token_left_gets_no_drafts() -> None:
    sched = _make(k=3, max_num_batched_tokens=5)
    sched.add_request(make_request("a", 2, max_tokens=20))
    sched.add_request(make_request("b", 2, max_tokens=20))
    _prefill(sched, {"a": [101, 102, 103], "b": [101, 102, 103]})
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4, "b": 1}
    assert list(so.spec_token_ids) == ["a"]
    _apply(sched, so, {"a": [9], "b": [9]})
    _end(sched)


@pytest.mark.parametrize(("max_tokens", "want"), [(2, []), (3, [101]), (4, [101, 102]),
                                                  (20, [101, 102, 103])])
def test_no_draft_past_the_last_allowed_output_token(max_tokens: int, want: list[int]) -> None:
    sched = _make(k=3)
    sched.add_request(make_request("a", 6, max_tokens=max_tokens))
    _prefill(sched, {"a": [101, 102, 103]})  # one output so far
    so = sched.schedule()
    assert so.spec_token_ids == ({"a": want} if want else {})
    assert so.num_scheduled_tokens == {"a": 1 + len(want)}
    outs = _apply(sched, so, {"a": [*want, 7]})  # every draft accepted, plus the bonus
    out = outs[0].outputs[0]
    assert out.new_token_ids == [*want, 7]
    if 2 + len(want) >= max_tokens:
        assert out.finish_reason == FinishReason.LENGTH
        assert len(sched_fakes._created_schedulers[-1].requests) == 0
    else:
        _end(sched)


def test_no_draft_past_max_model_len() -> None:
    sched = _make(k=6, max_model_len=12)
    sched.add_request(make_request("a", 8, max_tokens=None))
    _prefill(sched, {"a": [101, 102, 103, 104, 105, 106]})  # 9 tokens known
    so = sched.schedule()
    # Three more tokens fit: two drafts and the bonus.
    assert so.spec_token_ids == {"a": [101, 102]}
    req = sched.requests["a"]
    assert req.num_computed_tokens <= 12
    assert len(sched.kv_cache_manager.get_block_ids("a")) * BS <= 12
    outs = _apply(sched, so, {"a": [101, 102, 7]})
    out = outs[0].outputs[0]
    assert out.new_token_ids == [101, 102, 7] and out.finish_reason == FinishReason.LENGTH
    assert len(req.all_token_ids) == 12


class _Grammar:
    """Takes `valid` drafts in a row (the real one asks its matcher and rolls back)."""

    error: str | None = None

    def __init__(self, valid: int) -> None:
        self.valid = valid
        self.asked: list[list[int]] = []

    def ready(self) -> bool:
        return True

    def accept(self, tokens: Sequence[int]) -> bool:
        return True

    def valid_drafts(self, drafts: Sequence[int]) -> int:
        self.asked.append(list(drafts))
        return min(self.valid, len(drafts))


class _Source:
    def __init__(self, valid: int) -> None:
        self.grammars: list[_Grammar] = []
        self.valid = valid

    def grammar_for(self, params: StructuredOutputsParams, prompt: Sequence[int]) -> Any:
        self.grammars.append(_Grammar(self.valid))
        return self.grammars[-1]


@pytest.mark.parametrize("valid", [0, 1, 3])
def test_a_constrained_request_verifies_only_the_drafts_its_grammar_takes(valid: int) -> None:
    sched = _make(k=3)
    source = _Source(valid)
    sched.structured = source
    sched.add_request(make_request("c", 6, structured_outputs=StructuredOutputsParams(
        regex="a+")))
    sched.add_request(make_request("f", 6))
    _prefill(sched, {"c": [101, 102, 103], "f": [101, 102]})
    so = sched.schedule()
    assert source.grammars[0].asked == [[101, 102, 103]]
    assert so.num_scheduled_tokens == {"c": 1 + valid, "f": 3}
    want = {"c": [101, 102, 103][:valid]} if valid else {}
    assert so.spec_token_ids == {**want, "f": [101, 102]}
    assert so.grammar_req_ids == ["c"]
    drafts = [101, 102, 103]
    outs = _apply(sched, so, {"c": [*drafts[:valid], 5], "f": [101, 102, 5]})
    assert sched.requests["c"].num_computed_tokens == sched.requests["c"].num_tokens - 1
    assert {o.request_id for o in outs[0].outputs} == {"c", "f"}
    _end(sched)


# -- the KV cache ------------------------------------------------------------------------------


@pytest.mark.parametrize(("emitted", "hit"), [([110], 4), ([101, 110], 8)],
                         ids=["all-rejected", "one-accepted"])
def test_no_unverified_draft_position_reaches_the_prefix_cache(emitted: list[int],
                                                               hit: int) -> None:
    """Prompt of 6 (block 0 full), token 100 at position 6, drafts at 7, 8, 9: blocks 1 and
    2 hold draft positions. Block 1 may be cached only once position 7's token is verified
    (an accepted draft's KV is right; a rejected one's is not the correction's)."""
    sched = _make(k=3)
    kv = sched.kv_cache_manager
    sched.add_request(make_request("a", 6, max_tokens=20))
    _prefill(sched, {"a": [101, 102, 103]})
    so = sched.schedule()
    assert len(kv.get_block_ids("a")) == 3  # positions 0..9
    assert kv.block_pool.num_cached_blocks == 1 and sched.requests["a"].num_cached_blocks == 1
    _apply(sched, so, {"a": emitted})
    assert kv.block_pool.num_cached_blocks == 1
    known = list(sched.requests["a"].all_token_ids)
    sched.finish_requests("a")  # registers the blocks it computed
    assert kv.block_pool.num_cached_blocks == hit // BS
    # A follow-up turn over the same tokens hits exactly the verified full blocks.
    sched.add_request(make_request("b", [*known, 120], max_tokens=1))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == hit
    _apply(sched, so, {"b": [1]})


def test_a_preempted_request_caches_only_verified_positions() -> None:
    """The same through a preemption right after the rejection: the victim's blocks are
    registered up to its rolled-back computed count, and its resume hits only those."""
    sched = _make(k=3, num_blocks=6)  # 5 usable blocks of 4 tokens
    kv = sched.kv_cache_manager
    sched.add_request(make_request("a", 7, max_tokens=20))
    sched.add_request(make_request("b", 6, max_tokens=20))
    _prefill(sched, {"b": [101, 102, 103]})  # 2 blocks each
    so = sched.schedule()  # b verifies 3 drafts: positions 6..9, the last free block
    assert so.spec_token_ids == {"b": [101, 102, 103]}
    assert kv.block_pool.num_free_blocks == 0
    _apply(sched, so, {"a": [7], "b": [110]})  # all rejected: b's position 7 not verified
    assert sched.requests["b"].num_computed_tokens == 7
    assert kv.block_pool.num_cached_blocks == 2  # the prompts' first blocks
    so = sched.schedule()  # a's position 8 needs a block: b, the newest, is preempted
    assert so.preempted_req_ids == ["b"] and so.num_scheduled_tokens == {"a": 1}
    assert kv.block_pool.num_cached_blocks == 2  # not b's block 1 (position 7 holds a draft)
    _apply(sched, so, {"a": [8]})
    so = sched.schedule()  # b resumes from its one verified full block
    (resumed,) = [c for c in so.scheduled_cached_reqs if c.req_id == "b"]
    assert resumed.resumed_from_preemption and resumed.num_computed_tokens == 4
    _apply(sched, so, {"a": [9], "b": [9]})
    _end(sched)


def test_lookahead_slots_are_allocated() -> None:
    sched = _make(k=3, lookahead=2)
    kv = sched.kv_cache_manager
    sched.add_request(make_request("a", 6, max_tokens=20))
    so = sched.schedule()
    assert len(kv.get_block_ids("a")) == 2  # 6 + 2 slots
    _apply(sched, so, {"a": [100]}, {"a": [101, 102, 103]})
    for emitted in ([110], [111, 112]):
        req = sched.requests["a"]
        computed = req.num_computed_tokens
        so = sched.schedule()
        n = so.num_scheduled_tokens["a"]
        assert n == 4
        assert len(kv.get_block_ids("a")) == -(-(computed + n + 2) // BS)
        _apply(sched, so, {"a": emitted}, {"a": [111, 113, 114]})
    _end(sched)


def test_lookahead_stops_at_max_model_len() -> None:
    """The lookahead never reaches past max_model_len (the workers' block tables end there:
    a draft model's request crashed the engine at its last block before this was capped)."""
    sched = _make(k=3, lookahead=3, max_model_len=16)
    kv = sched.kv_cache_manager
    sched.add_request(make_request("a", 14, max_tokens=2))
    sched.schedule()
    assert len(kv.get_block_ids("a")) == 16 // BS  # 14 + 3 lookahead capped at 16 slots
    sched.finish_requests("a")
    _end(sched)


def test_lookahead_gives_way_when_the_cache_is_short() -> None:
    """A request that fits without the lookahead is admitted without it (it was refused as
    needing more blocks than the whole cache)."""
    sched = _make(k=3, lookahead=3, max_model_len=64, num_blocks=5)  # 4 usable blocks of 4
    kv = sched.kv_cache_manager
    sched.add_request(make_request("a", 15, max_tokens=1))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 15}
    assert len(kv.get_block_ids("a")) == 4
    sched.finish_requests("a")
    _end(sched)


# -- how requests end --------------------------------------------------------------------------


@pytest.mark.parametrize(("stop", "reason"), [(EOS, None), (55, 55)], ids=["eos", "stop-id"])
def test_a_stop_token_inside_an_accepted_run_ends_the_request_there(
        stop: int, reason: int | None) -> None:
    sched = _make(k=3)
    sched.add_request(make_request("a", 6, max_tokens=20, stop_token_ids=[55]))
    _prefill(sched, {"a": [101, stop, 103]})
    so = sched.schedule()
    outs = _apply(sched, so, {"a": [101, stop, 103, 104]})
    out = outs[0].outputs[0]
    assert out.new_token_ids == [101, stop]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == reason
    assert "a" not in sched.requests
    assert so.step_id < sched.schedule().step_id  # nothing left to run


def test_min_tokens_lets_a_stop_inside_the_run_pass() -> None:
    sched = _make(k=3)
    sched.add_request(make_request("a", 6, max_tokens=20, min_tokens=3))
    _prefill(sched, {"a": [EOS, EOS, 103]})
    so = sched.schedule()
    outs = _apply(sched, so, {"a": [EOS, EOS, 103, 104]})
    out = outs[0].outputs[0]
    # Outputs 2 and 3 are EOS: the 3rd reaches min_tokens and ends the request.
    assert out.new_token_ids == [EOS, EOS] and out.finish_reason == FinishReason.STOP


# -- stats -------------------------------------------------------------------------------------


def test_stats_count_drafts_accepted_and_per_position() -> None:
    sched = _make(k=3)
    sched.add_request(make_request("a", 6, max_tokens=30))
    sched.add_request(make_request("b", 6, max_tokens=30))
    sched.add_request(make_request("c", 6, max_tokens=30))
    so = sched.schedule()
    assert _stats(_apply(sched, so, {r: [100] for r in "abc"},
                         {"a": [101, 102, 103], "b": [101, 102]})) is None  # no drafts yet
    so = sched.schedule()
    stats = _stats(_apply(sched, so, {"a": [101, 102, 9], "b": [9], "c": [9]},
                          {"a": [1, 2, 3], "c": [1, 2, 3]}))
    # a: 3 drafts, 2 accepted; b: 2 drafts, none accepted; c: no drafts (not counted).
    assert stats == SpecDecodingStats(num_drafts=2, num_draft_tokens=5, num_accepted_tokens=2,
                                      num_accepted_tokens_per_pos=[1, 1, 0])
    so = sched.schedule()
    stats = _stats(_apply(sched, so, {"a": [1, 2, 3, 4], "b": [9], "c": [1, 5]}))
    assert stats == SpecDecodingStats(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=4,
                                      num_accepted_tokens_per_pos=[2, 1, 1])
    so = sched.schedule()
    assert _stats(_apply(sched, so, {r: [9] for r in "abc"})) is None  # deltas: reset
    _end(sched)


# -- DraftController ---------------------------------------------------------------------------


def test_batch_one_starts_with_drafts() -> None:
    controller = DraftController(4)
    assert controller.drafts_for_batch(1) == 4
    assert controller.drafts_for_batch(64) == 4  # never measured: speculate


def test_drafts_measured_slower_turn_off_and_are_explored_again() -> None:
    controller = DraftController(3)
    controller.observe(8, True, seconds=1.0, tokens=8)  # 0.125 s per token with drafts
    assert controller.drafts_for_batch(8) == 0  # the other mode is measured once
    controller.observe(8, False, seconds=0.5, tokens=8)  # 0.0625 s without: faster
    # Clearly slower (2x): measured again only every REVISIT_EVERY steps, two steps long.
    decisions = [controller.drafts_for_batch(8) for _ in range(REVISIT_EVERY + 1)]
    on = [i for i, k in enumerate(decisions) if k]
    assert on == [REVISIT_EVERY - 1, REVISIT_EVERY]
    assert all(k in (0, 3) for k in decisions)
    # A close call (within CLOSE_CALL): explored every EXPLORE_EVERY steps.
    close = DraftController(3)
    close.observe(8, True, seconds=0.56, tokens=8)
    close.drafts_for_batch(8)
    close.observe(8, False, seconds=0.5, tokens=8)
    decisions = [close.drafts_for_batch(8) for _ in range(2 * EXPLORE_EVERY)]
    on = [i for i, k in enumerate(decisions) if k]
    assert on == [EXPLORE_EVERY - 1, EXPLORE_EVERY, 2 * EXPLORE_EVERY - 1]
    # Batch sizes share a measurement per power of two: 5..8 with 8, not 4 or 9.
    assert controller.drafts_for_batch(5) == 0
    assert controller.drafts_for_batch(4) == 3 and controller.drafts_for_batch(9) == 3
    # A change of workload (drafts now accepted well) turns speculation back on.
    for _ in range(20):
        controller.observe(8, True, seconds=0.1, tokens=8)
    assert controller.drafts_for_batch(8) == 3


def test_pinned_drafts_per_batch_size() -> None:
    controller = DraftController(4, pinned=((1, 4), (8, 2), (32, 0)))
    assert [controller.drafts_for_batch(b) for b in (1, 7, 8, 31, 32, 256)] == [4, 4, 2, 2, 0, 0]
    controller.observe(8, True, seconds=100.0, tokens=1)  # measures nothing when pinned
    assert controller.drafts_for_batch(8) == 2
    assert DraftController(2, pinned=((1, 5),)).drafts_for_batch(1) == 2  # capped at k
    assert DraftController(2, pinned=((4, 2),)).drafts_for_batch(3) == 0  # below the first


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_the_scheduler_feeds_the_controller_and_follows_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps with drafts take 1 s and emit 2 tokens, steps without 0.1 s and 1: once both
    are measured the scheduler asks for no drafts (drafts are clearly slower: they are tried
    again only after REVISIT_EVERY steps)."""
    clock = _Clock()
    monkeypatch.setattr(scheduling, "time", clock)
    sched = _make(k=2)
    sched.add_request(make_request("a", 6, max_tokens=None))
    asked = []
    so = sched.schedule()
    asked.append(so.num_spec_tokens)
    _apply(sched, so, {"a": [100]}, {"a": [101, 102]})
    for _ in range(2 * EXPLORE_EVERY + 4):
        so = sched.schedule()
        drafted = bool(so.spec_token_ids)
        clock.now += 1.0 if drafted else 0.1
        sampled = [101, 9] if drafted else [9]
        drafts = {"a": [101, 102]} if so.num_spec_tokens else {}
        _apply(sched, so, {"a": sampled}, drafts)
        asked.append(so.num_spec_tokens)
    # prefill: 2; first decode (drafts, nothing measured yet): 2; then the mode without
    # drafts is measured: 0 while that step (which still carries drafts) runs, 0 for the
    # step without; then off.
    assert asked[:4] == [2, 2, 0, 0]
    assert not any(asked[4:]), asked
    _end(sched)
