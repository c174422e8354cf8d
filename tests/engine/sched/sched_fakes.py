"""Test helpers for the scheduler: builders, a fake worker that checks the wire contract and
the KV contents block by block, a driver for sync and async stepping, and the leak check
every scheduler test ends with (all blocks free, every ref count zero)."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ringserve.config import CacheConfig, SchedulerConfig, SchedulingPolicy
from ringserve.engine.sched.block_pool import BlockPool
from ringserve.engine.sched.scheduler import Scheduler
from ringserve.engine.wire import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from ringserve.gpu.wire import ModelRunnerOutput, SchedulerOutput
from ringserve.sampling_params import SamplingParams

EOS = 2
_created_schedulers: list[Scheduler] = []
_created_pools: list[BlockPool] = []


def make_scheduler(
    *,
    num_blocks: int = 1000,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 1024,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    policy: SchedulingPolicy = "fcfs",
    enable_prefix_caching: bool = True,
    eos_token_ids: tuple[int, ...] = (EOS,),
    log_stats: bool = True,
) -> Scheduler:
    """A scheduler registered for the end-of-test leak check."""
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            policy=policy,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
        eos_token_ids=eos_token_ids,
        log_stats=log_stats,
    )
    _created_schedulers.append(sched)
    return sched


def make_pool(num_blocks: int, enable_caching: bool = True) -> BlockPool:
    """A block pool registered for the end-of-test leak check."""
    pool = BlockPool(num_blocks, enable_caching)
    _created_pools.append(pool)
    return pool


def make_request(
    request_id: str,
    prompt: int | list[int],
    *,
    max_tokens: int | None = 16,
    priority: int = 0,
    arrival_time: float = 0.0,
    cache_salt: str | None = None,
    client_index: int = 0,
    **sampling: Any,
) -> EngineCoreRequest:
    """A request; an int prompt means that many distinct tokens derived from the id."""
    if isinstance(prompt, int):
        base = 10_000 + (zlib.crc32(request_id.encode()) % 1000) * 1000
        prompt = [base + i for i in range(prompt)]
    return EngineCoreRequest(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **sampling),
        arrival_time,
        priority=priority,
        cache_salt=cache_salt,
        client_index=client_index,
    )


def check_no_leaks() -> Iterator[None]:
    """Fixture body: after the test, every block of every scheduler and pool is free."""
    _created_schedulers.clear()
    _created_pools.clear()
    yield
    for sched in _created_schedulers:
        pool = sched.kv_cache_manager.block_pool
        sched.check_invariants()
        assert not sched.requests, f"test left requests in flight: {list(sched.requests)[:5]}"
        assert pool.num_free_blocks == pool.num_usable_blocks, "blocks still in use"
        assert pool.ref_cnt[1:] == [0] * pool.num_usable_blocks
    for pool in _created_pools:
        pool.check_invariants()
        assert pool.num_free_blocks == pool.num_usable_blocks, "blocks still in use"
        assert pool.ref_cnt[1:] == [0] * pool.num_usable_blocks
    _created_schedulers.clear()
    _created_pools.clear()


def default_sampler(request_id: str, index: int) -> int:
    """Token `index` of a request's output: deterministic, never EOS."""
    return 100 + (zlib.crc32(f"{request_id}/{index}".encode()) % 800)


@dataclass
class _WorkerRequest:
    prompt_len: int
    tokens: list[int]
    blocks: list[int]
    computed: int


@dataclass
class FakeWorker:
    """A worker that follows the SchedulerOutput contract and simulates the KV cache.

    It keeps its own view of every request (from NewRequestData / CachedRequestData only),
    writes each computed position's token id into a (block, offset) slot, and checks that
    every position a step attends to holds the right token: prefix-cache hits, preemption and
    resume, and block tables are thereby checked against what a real worker would compute.
    """

    block_size: int
    sampler: Callable[[str, int], int] = default_sampler
    reqs: dict[str, _WorkerRequest] = field(default_factory=dict)
    prompt_lens: dict[str, int] = field(default_factory=dict)
    kv: dict[tuple[int, int], int] = field(default_factory=dict)
    steps: int = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns the sampled tokens."""
        self.steps += 1
        self._apply_diff(so)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        bs = self.block_size
        # Pass 1: write the new positions' KV (as a layer does for the whole batch).
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            assert n > 0 and st.computed + n <= len(st.tokens), (rid, n, st.computed, len(st.tokens))
            assert len(st.blocks) * bs >= st.computed + n, "not enough slots"
            assert 0 not in st.blocks, "null block in a block table"
            for pos in range(st.computed, st.computed + n):
                self.kv[(st.blocks[pos // bs], pos % bs)] = st.tokens[pos]
        # Pass 2: attention reads every earlier position; sample at the end of the sequence.
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            for pos in range(st.computed + n):
                got = self.kv.get((st.blocks[pos // bs], pos % bs))
                assert got == st.tokens[pos], f"{rid}: KV at position {pos} holds {got}, not {st.tokens[pos]}"
            st.computed += n
            req_ids.append(rid)
            if st.computed == len(st.tokens):
                token = self.sampler(rid, len(st.tokens) - st.prompt_len)
                st.tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(so.step_id, req_ids, sampled)

    def skip(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Skip one step as a worker does while a pause holds the steps
        (`ringserve.gpu.executor.step_hold`): its bookkeeping only, no KV written, nothing
        sampled; the requests that would have sampled are listed."""
        self._apply_diff(so, skipping=True)
        # The step's own computed counts: one skipped before it did not advance the worker's.
        computed = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        computed.update((c.req_id, c.num_computed_tokens) for c in so.scheduled_cached_reqs)
        sampling = [rid for rid, n in so.num_scheduled_tokens.items()
                    if computed[rid] + n >= len(self.reqs[rid].tokens)]
        return ModelRunnerOutput(so.step_id, sampling, [[] for _ in sampling], skipped=True)

    def _apply_diff(self, so: SchedulerOutput, skipping: bool = False) -> None:
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
            self.prompt_lens.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs
            self.prompt_lens[new.req_id] = len(new.prompt_token_ids)
            self.reqs[new.req_id] = _WorkerRequest(
                len(new.prompt_token_ids),
                list(new.prompt_token_ids) + list(new.output_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
            )
        for cached in so.scheduled_cached_reqs:
            if cached.resumed_from_preemption:
                assert cached.req_id not in self.reqs
                self.reqs[cached.req_id] = _WorkerRequest(
                    self.prompt_lens[cached.req_id],
                    list(cached.all_token_ids),
                    list(cached.new_block_ids),
                    cached.num_computed_tokens,
                )
            else:
                st = self.reqs[cached.req_id]
                # A step skipped before this one did not advance the count.
                assert skipping or st.computed == cached.num_computed_tokens, (cached, st.computed)
                st.blocks.extend(cached.new_block_ids)


@dataclass
class Driver:
    """Steps a scheduler with a FakeWorker, synchronously or with one step in flight."""

    sched: Scheduler
    async_scheduling: bool = False
    sampler: Callable[[str, int], int] = default_sampler
    worker: FakeWorker = field(init=False)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, EngineCoreOutput] = field(default_factory=dict)
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = field(default_factory=list)
    check: bool = True
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0

    def __post_init__(self) -> None:
        self.worker = FakeWorker(self.sched.block_size, self.sampler)

    def collect(self, outs: dict[int, EngineCoreOutputs]) -> None:
        """Record outputs (tokens per request, final outputs)."""
        for batch in outs.values():
            stats = batch.scheduler_stats
            if stats is not None:
                self.num_preemptions += stats.num_preemptions
                self.prefix_queries += stats.prefix_cache_queries
                self.prefix_hits += stats.prefix_cache_hits
            for out in batch.outputs:
                assert out.request_id not in self.finished, f"output after finish: {out}"
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    self.finished[out.request_id] = out

    def step(self) -> SchedulerOutput:
        """Schedule one step (and, in async mode, then apply the previous one)."""
        so = self.sched.schedule()
        self.in_flight.append((so, self.worker.execute(so)))
        if self.check:
            self.sched.check_invariants()
        depth = 2 if self.async_scheduling else 1
        while len(self.in_flight) >= depth:
            self.apply_one()
        return so

    def pause(self, num_skipped: int = 1) -> None:
        """A pause arrives (`ringserve.gpu.executor.step_hold`): the next `num_skipped`
        steps are scheduled and skipped by the worker (the first one while the step before
        it, in async mode, is still in flight), then every step in flight is applied."""
        for _ in range(num_skipped):
            so = self.sched.schedule()
            self.in_flight.append((so, self.worker.skip(so)))
        self.flush()

    def apply_one(self) -> None:
        """Apply the oldest step in flight (taking back one the worker skipped)."""
        so, mro = self.in_flight.pop(0)
        if mro.skipped:
            self.sched.rollback_step(so, mro)
            self.collect(self.sched.take_pending_outputs())
        else:
            self.collect(self.sched.update_from_output(so, mro))
        if self.check:
            self.sched.check_invariants()

    def flush(self) -> None:
        """Apply every step in flight."""
        while self.in_flight:
            self.apply_one()

    def run(self, max_steps: int = 10_000) -> int:
        """Step until nothing is left; returns the number of steps."""
        steps = 0
        while self.sched.has_requests() or self.in_flight:
            if not self.sched.has_requests():
                self.flush()
                continue
            self.step()
            steps += 1
            assert steps <= max_steps, "scheduler did not drain"
        return steps

    def reason(self, request_id: str) -> FinishReason | None:
        """The finish reason a request got (None if it has not finished)."""
        out = self.finished.get(request_id)
        return None if out is None else out.finish_reason
