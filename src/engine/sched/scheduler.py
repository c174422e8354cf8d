"""The engine core's scheduler: which requests run each step, and what their outputs mean.

Called by the engine core's busy loop: `add_request` / `finish_requests` between steps,
`schedule()` to build the step's `SchedulerOutput` for the workers, and
`update_from_output()` with the workers' `ModelRunnerOutput` to append sampled tokens, check
stop conditions and build the `EngineCoreOutputs` for the frontend clients. A thin policy over
small managers: the waiting queue (`request_queue.py`), the KV cache manager
(`kv_cache_manager.py`, over `block_pool.py`), admission limits (`admission.py`) and the
output-side token handling (`scheduler_update.py`); how requests end and what the core asks
of the books between steps is `scheduler_books.py`.

Each step has one token budget (`max_num_batched_tokens`). Running requests are served first
(decodes and unfinished chunked prefills, in admission order), then waiting ones, while
`max_num_seqs` allows; prompts are chunked to the budget (and to
`long_prefill_token_threshold`). When the KV cache runs out, running requests are preempted by
recompute (FCFS: the newest; priority: the lowest priority, latest arrival) and go back to the
front of the waiting queue, and no new request is admitted that step.

Async scheduling: `num_computed_tokens` advances when a step is *scheduled*, and each step that
will sample a token adds an output placeholder, so step N+1 can be scheduled before step N's
tokens arrive. Outputs that arrive for a request that was finished, aborted or preempted since
their step was scheduled are discarded.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any, Protocol

from ringserve.config import CacheConfig, SchedulerConfig
from ringserve.engine.sched.admission import RequestLimits
from ringserve.engine.sched.kv_cache_manager import KVCacheManager
from ringserve.engine.sched.request import Request, RequestStatus
from ringserve.engine.sched.request_queue import create_request_queue
from ringserve.engine.sched.scheduler_books import BooksMixin
from ringserve.engine.wire import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
)
from ringserve.gpu.multimodal.scheduling import EncoderBooks
from ringserve.gpu.spec_decode.scheduling import SpecScheduling
from ringserve.gpu.wire import CachedRequestData, NewRequestData, SchedulerOutput
from ringserve.sampling_params import StructuredOutputsParams

__all__ = ["Scheduler"]

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


class GrammarSource(Protocol):
    """What compiles a constrained request's grammar (the core's StructuredOutputManager)."""

    def grammar_for(self, params: StructuredOutputsParams,
                    prompt_token_ids: Sequence[int]) -> Any:
        """A grammar handle with `ready()`, `error`, `accept(tokens)` (see manager.py)."""
        ...


class _Step:
    """What one `schedule()` call has decided so far."""

    __slots__ = ("budget", "new", "num_scheduled", "preempted", "resumed", "running", "spec",
                 "step_id")

    def __init__(self, step_id: int, budget: int) -> None:
        self.step_id = step_id
        self.budget = budget
        self.running: list[tuple[Request, int, list[int]]] = []
        self.new: list[Request] = []
        self.resumed: list[Request] = []
        self.num_scheduled: dict[str, int] = {}
        self.preempted: list[str] = []
        self.spec: dict[str, list[int]] = {}  # request -> the drafts it verifies

    def unschedule(self, request: Request) -> None:
        """Take back a running request scheduled earlier in this step (it was preempted)."""
        n = self.num_scheduled.pop(request.request_id, None)
        if n is not None:
            self.budget += n
            self.running = [entry for entry in self.running if entry[0] is not request]
            self.spec.pop(request.request_id, None)


class Scheduler(BooksMixin):
    """Continuous batching with chunked prefill, preemption and prefix caching.

    Args:
        scheduler_config: budgets, limits, policy.
        cache_config: block size and prefix caching.
        num_blocks: KV blocks the workers allocated (the null block included), measured at
            start-up and passed separately from the config.
        eos_token_ids: ids that end generation unless a request sets ignore_eos (from
            `ModelConfig.eos_token_ids`).
        log_stats: record life-cycle events and attach `SchedulerStats` to outputs.
        engine_index: this core's data-parallel rank, stamped on its outputs.
        structured: compiles structured-output grammars (the core's
            `StructuredOutputManager`); None refuses constrained requests.
        spec: speculative decoding's books (`ringserve.gpu.spec_decode.scheduling`); None:
            speculation is off.
        max_loras: the LoRA adapters one step may hold (`--max-loras`; 0: LoRA is off). A
            waiting request whose adapter would be one too many waits, and so does every
            request after it (first come, first served within the slot limit).
        encoder: the image encoder's budget and cache books
            (`ringserve.gpu.multimodal.scheduling`); None: a text-only model.

    Raises:
        ValueError: a budget or limit below 1, or too few blocks.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        *,
        eos_token_ids: Iterable[int] = (),
        log_stats: bool = True,
        engine_index: int = 0,
        structured: GrammarSource | None = None,
        spec: SpecScheduling | None = None,
        max_loras: int = 0,
        encoder: EncoderBooks | None = None,
    ) -> None:
        cfg = scheduler_config
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(cfg, name) < 1:
                raise ValueError(f"{name}: got {getattr(cfg, name)}, allowed: >= 1")
        self.scheduler_config = cfg
        self.cache_config = cache_config
        self.max_num_seqs = cfg.max_num_seqs
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self.max_model_len = cfg.max_model_len
        self.enable_chunked_prefill = cfg.enable_chunked_prefill
        threshold = cfg.long_prefill_token_threshold
        self.long_prefill_token_threshold = threshold if threshold > 0 else cfg.max_num_batched_tokens
        self.policy = cfg.policy
        self.eos_token_ids = frozenset(eos_token_ids)
        self.log_stats = log_stats
        self.engine_index = engine_index
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.limits = RequestLimits(
            max_model_len=cfg.max_model_len,
            block_size=cache_config.block_size,
            num_usable_blocks=num_blocks - 1,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
        )
        self.waiting = create_request_queue(cfg.policy)
        self.structured = structured
        self.spec = spec
        self.max_loras = max_loras
        self.encoder = encoder
        self._lookahead = spec.lookahead if spec is not None else 0
        # Constrained requests whose grammar is still compiling (not in `waiting` yet).
        self.waiting_for_grammar: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._step_id = 0
        self._num_preemptions = 0
        # FLOPs of steps scheduled since the last make_stats() (the core adds them; MFU metrics).
        self.pending_flops = 0.0
        # Finished since the last schedule(): workers drop their state.
        self._finished_req_ids: list[str] = []
        self._invalidated: list[str] = []  # preempted by new weights, for the next step
        # Requests a skipped step admitted and `rollback_step` queued again (until the next
        # step: the later skipped steps that name them are taken back before it).
        self._taken_back: set[str] = set()
        # Outputs produced between steps (admission errors, notified aborts), per client.
        self._pending_outputs: list[tuple[int, EngineCoreOutput]] = []
        # Finished since the last update_from_output(), per client.
        self._finished_by_client: dict[int, list[str]] = {}

    # -- intake --------------------------------------------------------------------------------

    def check_request(self, request: EngineCoreRequest) -> None:
        """The admission check the frontend runs before sending (same as `add_request`'s).

        Raises:
            ValueError: the request can never be served; the message says why.
        """
        self.limits.check(len(request.prompt_token_ids))

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one that can never be served finishes with an ERROR output.

        The ERROR output (its `stop_reason` holds the message) comes with the next
        `update_from_output()` or `take_pending_outputs()`.

        Raises:
            ValueError: a request with this id is already in flight (a frontend bug).
        """
        request_id = request.request_id
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already in flight in this engine core")
        req = Request.from_engine_core_request(
            request, max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids
        )
        problem = self.limits.problem(req.num_prompt_tokens)
        if problem is None and req.mm_features:
            problem = self._image_problem(req)
        if problem is not None:
            req.status = RequestStatus.FINISHED_ERROR
            req.error = problem
            self._queue_output(req, FinishReason.ERROR)
            return
        constraint = req.sampling_params.structured_outputs
        if constraint is not None and self.structured is None:
            req.status = RequestStatus.FINISHED_ERROR
            req.error = "structured outputs are not available in this engine core"
            self._queue_output(req, FinishReason.ERROR)
            return
        self.kv_cache_manager.hash_request(req)
        self.requests[request_id] = req
        if constraint is not None and self.structured is not None:
            req.grammar = self.structured.grammar_for(constraint, req.prompt_token_ids)
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(req)
        else:
            self.waiting.add(req)
        if self.log_stats:
            req.record_event(EngineCoreEventType.QUEUED, time.monotonic())

    def _image_problem(self, req: Request) -> str | None:
        """Why a request's images can never be served here, or None."""
        if self.encoder is None:
            return "holds images, but this model takes text only"
        return self.encoder.problem(req.mm_features or [], req.num_prompt_tokens,
                                    self.max_num_batched_tokens)

    # -- scheduling ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next step: which requests compute how many tokens, in which blocks.

        Returns:
            The step for the workers; requests they have not seen carry their full data,
            the others only what changed.
        """
        self._step_id += 1
        if self._taken_back:
            self._taken_back.clear()
        if self.waiting_for_grammar:
            self._admit_compiled()
        step = _Step(self._step_id, self.max_num_batched_tokens)
        if self.encoder is not None:
            self.encoder.begin_step()
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        return self._build_output(step)

    def _admit_compiled(self) -> None:
        """Move constrained requests whose grammar is ready into the waiting queue (in
        arrival order); one whose grammar failed ends with its error."""
        still: list[Request] = []
        for req in self.waiting_for_grammar:
            if not req.grammar.ready():
                still.append(req)
            elif req.grammar.error is not None:
                self._fail(req, f"cannot be constrained: {req.grammar.error}")
            else:
                req.status = RequestStatus.WAITING
                self.waiting.add(req)
        self.waiting_for_grammar = still

    def _schedule_running(self, step: _Step) -> None:
        running = self.running
        # Block registration in the prefix cache waits until no preemption can take this
        # step back (see _cache_scheduled_running): a victim scheduled earlier in the loop
        # never writes its slots, and a cached hash over them would serve garbage later.
        kv = self.kv_cache_manager
        allocate = partial(kv.allocate_slots, cache_blocks=False)
        threshold = self.long_prefill_token_threshold
        spec, lookahead = self.spec, self._lookahead
        encoder = self.encoder
        i = 0
        while i < len(running) and step.budget > 0:
            req = running[i]
            placeholders = req.num_output_placeholders
            num_tokens = len(req.all_token_ids)
            # Async scheduling: the pending outputs already reach max_tokens.
            if placeholders and num_tokens - req.num_prompt_tokens + placeholders >= req.max_tokens:
                i += 1
                continue
            n = num_tokens + placeholders - req.num_computed_tokens
            if n > threshold:
                n = threshold
            if n > step.budget:
                n = step.budget
            if encoder is not None and req.mm_features:
                n = encoder.fit(req, req.num_computed_tokens, n)
            if n <= 0:
                i += 1
                continue
            drafts = None
            if spec is not None and n == 1:
                drafts = spec.drafts_for(req.request_id, min(
                    step.budget - 1, req.max_tokens - (num_tokens - req.num_prompt_tokens) - 1,
                    self.max_model_len - num_tokens))
                if drafts and req.grammar is not None:
                    # Drafts the grammar forbids are cut before they cost a row.
                    drafts = drafts[:req.grammar.valid_drafts(drafts)]
                n += len(drafts)
            ahead = self._lookahead_for(req, n) if lookahead else 0
            new_blocks = allocate(req, n, ahead)
            while new_blocks is None:
                if ahead:  # the draft model's lookahead goes before any request does
                    ahead = 0
                    new_blocks = allocate(req, n, 0)
                    continue
                removed = self._make_room(req, i, step)
                if removed < 0 or removed == i:
                    break  # req waits for its pending outputs, or left the running list
                if removed < i:
                    i -= 1
                new_blocks = allocate(req, n, 0)
            if new_blocks is None:
                if i < len(running) and running[i] is req:
                    i += 1
                continue
            step.running.append((req, n, new_blocks))
            step.num_scheduled[req.request_id] = n
            step.budget -= n
            if drafts:
                step.spec[req.request_id] = drafts
            i += 1
        drafted = step.spec
        for req, n, new_blocks in step.running:
            if new_blocks:
                # Only verified tokens enter the prefix cache: not a step's drafts.
                unverified = len(drafted.get(req.request_id, ())) if drafted else 0
                kv.cache_blocks(req, req.num_computed_tokens + n - unverified)

    def _make_room(self, req: Request, index: int, step: _Step) -> int:
        """Preempt one victim so `req` (at `index`) can grow.

        Returns:
            The running-list index of the request that left (the victim, or `req` itself
            when it is the victim or can never fit), or -1 when `req` should just wait.
        """
        running = self.running
        if len(running) == 1:
            if req.num_output_placeholders:
                # Async: its pending outputs may end it; decide once they have arrived.
                return -1
            # Alone and still no room: it needs more blocks than the whole cache.
            del running[index]
            self._fail(req, "needs more KV blocks than the whole cache holds "
                       f"({self.limits.num_usable_blocks} blocks of {self.block_size} tokens)")
            return index
        if self.policy == "priority":
            victim = max(running, key=lambda r: (r.priority, r.arrival_time, r.seq))
            victim_index = running.index(victim)
        else:
            victim_index = len(running) - 1
            victim = running[victim_index]
        del running[victim_index]
        self._preempt(victim, step)
        return victim_index

    def _preempt(self, req: Request, step: _Step) -> None:
        step.unschedule(req)
        self._free_blocks(req)
        req.status = _PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.num_preemptions += 1
        self._num_preemptions += 1
        if self.log_stats:
            req.record_event(EngineCoreEventType.PREEMPTED, time.monotonic())
        self.waiting.prepend(req)
        step.preempted.append(req.request_id)

    def _schedule_waiting(self, step: _Step) -> None:
        waiting = self.waiting
        running = self.running
        kv = self.kv_cache_manager
        threshold = self.long_prefill_token_threshold
        now = time.monotonic() if self.log_stats else 0.0
        adapters = ({r.lora_request.identity for r in running if r.lora_request is not None}
                    if self.max_loras else None)
        while waiting and step.budget > 0 and len(running) < self.max_num_seqs:
            req = waiting.peek()
            if adapters is not None and req.lora_request is not None:
                identity = req.lora_request.identity
                if identity not in adapters:
                    if len(adapters) >= self.max_loras:
                        break  # its adapter waits for a slot; nobody overtakes it
                    adapters.add(identity)
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(req)
            n = len(req.all_token_ids) - num_hit_tokens
            if n > threshold:
                n = threshold
            if n > step.budget:
                if not self.enable_chunked_prefill and n <= self.max_num_batched_tokens:
                    break  # waits for a step with the whole budget free
                n = step.budget
            if self.encoder is not None and req.mm_features:
                wanted = n
                n = self.encoder.fit(req, num_hit_tokens, n)
                if n <= 0 or (n < wanted and not self.enable_chunked_prefill):
                    self.encoder.cancel(req)
                    break  # its images wait for encoder budget or cache room
            ahead = self._lookahead_for(req, n, num_hit_tokens) if self._lookahead else 0
            if (kv.allocate_slots(req, n, ahead, new_computed_blocks=hit_blocks) is None
                    and (not ahead or kv.allocate_slots(
                        req, n, 0, new_computed_blocks=hit_blocks) is None)):
                if self.encoder is not None:
                    self.encoder.cancel(req)
                if running:
                    break
                waiting.pop()  # nothing else holds blocks: it can never fit
                self._fail(req, "needs more KV blocks than the whole cache holds "
                           f"({self.limits.num_usable_blocks} blocks of {self.block_size} tokens)")
                continue
            waiting.pop()
            kv.record_prefix_lookup(req, num_hit_tokens)
            if req.status is _PREEMPTED:
                step.resumed.append(req)
            else:
                step.new.append(req)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            req.num_computed_tokens = num_hit_tokens
            req.status = _RUNNING
            req.scheduled_since_step = step.step_id
            req.was_scheduled = True
            if self.log_stats:
                req.record_event(EngineCoreEventType.SCHEDULED, now)
            running.append(req)
            step.num_scheduled[req.request_id] = n
            step.budget -= n

    def _lookahead_for(self, req: Request, n: int, computed: int | None = None) -> int:
        """The draft model's lookahead slots for `req` computing `n` tokens from `computed`
        (its computed count when not given): the configured number, but never past
        max_model_len (the workers' block tables end there)."""
        start = req.num_computed_tokens if computed is None else computed
        return max(0, min(self._lookahead, self.max_model_len - start - n))

    def _take_invalidated(self, preempted: list[str]) -> list[str]:
        if not self._invalidated:
            return preempted
        ids, self._invalidated = [*self._invalidated, *preempted], []
        return ids

    def _build_output(self, step: _Step) -> SchedulerOutput:
        num_scheduled = step.num_scheduled
        grammar_ids: list[str] = []  # constrained requests that sample this step
        cached: list[CachedRequestData] = []
        append = cached.append
        for req, n, new_blocks in step.running:
            computed = req.num_computed_tokens
            if new_blocks:
                append(CachedRequestData(req.request_id, computed, new_blocks))
            else:
                append(CachedRequestData(req.request_id, computed))
            # `_advance` inlined (the hot loop).
            computed += n
            req.num_computed_tokens = computed
            if computed >= len(req.all_token_ids) + req.num_output_placeholders:
                req.num_output_placeholders += 1
                if req.grammar is not None:
                    grammar_ids.append(req.request_id)
        get_blocks = self.kv_cache_manager.get_block_ids
        for req in step.resumed:
            append(
                CachedRequestData(
                    req.request_id,
                    req.num_computed_tokens,
                    list(get_blocks(req.request_id)),
                    resumed_from_preemption=True,
                    all_token_ids=list(req.all_token_ids),
                )
            )
            if _advance(req, num_scheduled[req.request_id]) and req.grammar is not None:
                grammar_ids.append(req.request_id)
        new_reqs = []
        for req in step.new:
            new_reqs.append(
                NewRequestData(
                    req.request_id,
                    req.prompt_token_ids,
                    req.sampling_params,
                    list(get_blocks(req.request_id)),
                    req.num_computed_tokens,
                    pooling_params=req.pooling_params,
                    lora_request=req.lora_request,
                    mm_features=req.mm_features,
                )
            )
            if req.mm_features:  # the workers keep the arrays from here on
                req.mm_features = [f.without_data() for f in req.mm_features]
            if _advance(req, num_scheduled[req.request_id]) and req.grammar is not None:
                grammar_ids.append(req.request_id)
        finished = self._finished_req_ids
        self._finished_req_ids = []
        num_spec = 0
        if self.spec is not None:
            num_spec = self.spec.begin_step(len(self.running), bool(step.spec))
        encodes, freed = self.encoder.take_step() if self.encoder is not None else ({}, [])
        return SchedulerOutput(
            step_id=step.step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - step.budget,
            finished_req_ids=finished,
            preempted_req_ids=self._take_invalidated(step.preempted),
            grammar_req_ids=grammar_ids,
            spec_token_ids=step.spec,
            num_spec_tokens=num_spec,
            encoder_inputs=encodes,
            free_encoder_ids=freed,
        )

def _advance(req: Request, n: int) -> bool:
    """Book `n` scheduled tokens as computed; a step that reaches the end samples a token
    (returns True then)."""
    computed = req.num_computed_tokens + n
    req.num_computed_tokens = computed
    if computed >= len(req.all_token_ids) + req.num_output_placeholders:
        req.num_output_placeholders += 1
        return True
    return False
