"""The scheduler's books: ending requests (aborts, errors, rejections), their final outputs,
and the queries the engine core asks between steps.

Half of `Scheduler` (a mixin, as `scheduler_update.py` is for the output side): the state
lives in `Scheduler.__init__`; this module owns how a request leaves it (`finish_requests`,
`abort_all`, `reject_request`, freeing its blocks and queuing its final output) and what the
core reads of it (`has_requests`, `make_stats`, `check_invariants`, ...). Plain Python.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ringserve.engine.sched.request import Request, RequestStatus
from ringserve.engine.sched.scheduler_update import OutputMixin
from ringserve.engine.wire import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from ringserve.gpu.multimodal.scheduling import EncoderBooks
from ringserve.gpu.wire import ModelRunnerOutput, SchedulerOutput

__all__ = ["BooksMixin"]

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


class BooksMixin(OutputMixin):
    """Finishing and queries; the state lives in `Scheduler`."""

    waiting: Any
    waiting_for_grammar: list[Request]
    max_num_seqs: int
    max_loras: int
    encoder: EncoderBooks | None
    _finished_req_ids: list[str]
    _invalidated: list[str]
    _taken_back: set[str]
    running: list[Request]
    _num_preemptions: int
    _step_id: int
    pending_flops: float
    limits: Any

    def reject_request(self, request: EngineCoreRequest, error: str | None) -> None:
        """End a request that was never queued with a final output: ERROR carrying `error`
        (it could not be added), or ABORT when `error` is None (it was held while paused);
        a request in flight under the same id is left alone."""
        reason = FinishReason.ABORT if error is None else FinishReason.ERROR
        output = EngineCoreOutput(request.request_id, [], finish_reason=reason, stop_reason=error)
        self._pending_outputs.append((request.client_index, output))

    # -- finishing -----------------------------------------------------------------------------

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        reason: FinishReason = FinishReason.ABORT,
        *,
        notify: bool = False,
    ) -> None:
        """End requests now (aborts), freeing their blocks at once; unknown ids are ignored.

        Args:
            request_ids: one id or several.
            reason: the finish reason (ABORT for client aborts, ERROR for engine faults).
            notify: also send each one a final output (with the next `update_from_output()`
                or `take_pending_outputs()`); the frontend does not need one for aborts it
                asked for itself.
        """
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        status = RequestStatus.for_reason(reason)
        from_waiting: set[Request] = set()
        from_running = False
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None:
                continue
            if req.status is _RUNNING:
                from_running = True
            else:
                from_waiting.add(req)
            req.status = status
            self._free_request(req)
            if notify:
                self._queue_output(req, reason)
        if from_waiting and self.waiting_for_grammar:
            compiling = {r for r in from_waiting if r in self.waiting_for_grammar}
            if compiling:
                self.waiting_for_grammar = [r for r in self.waiting_for_grammar
                                            if r not in compiling]
                from_waiting -= compiling
        if from_waiting:
            self.waiting.remove_many(from_waiting)
        if from_running:
            self.running = [r for r in self.running if r.status is _RUNNING]

    def abort_all(self, reason: FinishReason = FinishReason.ABORT,
                  error: str | None = None) -> dict[int, EngineCoreOutputs]:
        """End every request (engine fault), free all blocks, and return their final outputs.

        Args:
            reason: the finish reason of every request.
            error: with ERROR, the message each request's final output carries.
        """
        if error is not None:
            for req in self.requests.values():
                req.error = error
        self.finish_requests(list(self.requests), reason, notify=True)
        if self.encoder is not None:
            self.encoder.reset()  # a fault: the workers' encoder cache may be gone
        return self.take_pending_outputs()

    def _fail(self, req: Request, problem: str) -> None:
        """End a request that can never be served with an ERROR output (already dequeued)."""
        req.status = RequestStatus.FINISHED_ERROR
        req.error = f"request {req.request_id!r} ({req.num_tokens} tokens) {problem}"
        self._free_request(req)
        self._queue_output(req, FinishReason.ERROR)

    def _free_blocks(self, req: Request) -> None:
        """Give back what a request holds while it runs: its KV blocks, and its pins on
        the encoder cache's images (`ringserve.gpu.multimodal.scheduling`)."""
        self.kv_cache_manager.free(req)
        if self.encoder is not None:
            self.encoder.release(req)

    def _free_request(self, req: Request) -> None:
        self._free_blocks(req)
        del self.requests[req.request_id]
        if req.was_scheduled:
            self._finished_req_ids.append(req.request_id)
        by_client = self._finished_by_client.get(req.client_index)
        if by_client is None:
            self._finished_by_client[req.client_index] = [req.request_id]
        else:
            by_client.append(req.request_id)

    def _queue_output(self, req: Request, reason: FinishReason) -> None:
        output = EngineCoreOutput(
            req.request_id,
            [],
            finish_reason=reason,
            stop_reason=req.error if reason == FinishReason.ERROR else None,
            events=req.take_events(),
            num_cached_tokens=max(req.num_cached_tokens, 0),
        )
        self._pending_outputs.append((req.client_index, output))

    # -- queries -------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        """True when workers must still be told about finished requests."""
        return bool(self._finished_req_ids)

    def has_pending_outputs(self) -> bool:
        """True when outputs made between steps (errors, notified aborts) wait to be sent."""
        return bool(self._pending_outputs)

    def has_requests(self) -> bool:
        """True when the engine core should step: unfinished work or undelivered results
        (a request whose grammar is still compiling does not count: the compile's end
        wakes the core)."""
        compiling = self.waiting_for_grammar
        if compiling and len(self.requests) == len(compiling):
            return any(r.grammar.ready() for r in compiling) or bool(
                self._finished_req_ids or self._pending_outputs)
        return bool(self.requests or self._finished_req_ids or self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        """Waiting plus running requests."""
        return len(self.requests)

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        return len(self.running), len(self.waiting)

    def invalidate_computed_kv(self) -> int:
        """The model's weights changed: every running request's KV is stale. Each is
        preempted (its blocks freed, to recompute from its prompt and the tokens it has) and
        queued first, in its running order; the workers hear of it with the next step.
        Call with no step in flight. Returns the number of requests preempted."""
        running = list(self.running)
        for req in reversed(running):  # prepended in reverse: the queue keeps their order
            self._free_blocks(req)
            req.status = _PREEMPTED
            req.num_computed_tokens = 0
            req.num_output_placeholders = 0
            req.num_preemptions += 1
            self.waiting.prepend(req)
            if req.was_scheduled:
                self._invalidated.append(req.request_id)
        self.running.clear()
        if self.encoder is not None:
            self.encoder.reset()  # the workers' encoder rows are the old weights' too
        return len(running)

    def rollback_step(self, scheduler_output: SchedulerOutput,
                      model_output: ModelRunnerOutput) -> None:
        """Take back a step the workers skipped (a pause came: `ringserve.gpu.executor.
        step_hold`), so its requests are scheduled again exactly as they were.

        The workers applied its bookkeeping (new, finished and preempted requests, blocks),
        so that stays; what it would have computed is taken back: each request's computed
        count (back to what the step says it was before it) and, where it would have sampled
        (`model_output.req_ids`), its placeholder; the prefix-cache entries of the blocks it
        would have written. A request admitted by this step goes back to the front of the
        waiting queue with its blocks freed (the workers release its slot with the next step
        and keep its state for the resume).

        Skipped steps are always the newest in flight (once one is skipped, every later one
        is), and are taken back oldest first: the first taken back sets a request's count to
        where the skipped ones began (a count a later one would restore is higher: `min`).

        A request of the step whose blocks were freed since it was scheduled (it finished,
        was aborted or preempted meanwhile) had them registered in the prefix cache up to
        its computed count, which counted this step's positions: their KV was never
        written, and the blocks are no longer known here. The whole prefix cache is then
        reset (blocks in use stay with their requests): a pause costs the cached prefixes
        then, never a stale one served.
        """
        if model_output.request_errors:
            self._fail_in_worker(model_output.request_errors)
        step_id = scheduler_output.step_id
        sampling = set(model_output.req_ids)
        kv = self.kv_cache_manager
        requests = self.requests
        before = {new.req_id: new.num_computed_tokens
                  for new in scheduler_output.scheduled_new_reqs}
        before.update((cached.req_id, cached.num_computed_tokens)
                      for cached in scheduler_output.scheduled_cached_reqs)
        unadmitted: list[Request] = []
        freed_since = False
        for request_id in scheduler_output.num_scheduled_tokens:
            req = requests.get(request_id)
            if req is None or req.status is not _RUNNING or step_id < req.scheduled_since_step:
                # Gone, or preempted since: its books were reset then; its blocks were freed
                # (registered) unless an earlier skipped step already took it back.
                if request_id not in self._taken_back:
                    freed_since = True
                continue
            if before[request_id] < req.num_computed_tokens:
                req.num_computed_tokens = before[request_id]
            if request_id in sampling and req.num_output_placeholders:
                req.num_output_placeholders -= 1
            kv.uncache_from(req, req.num_computed_tokens)
            if req.scheduled_since_step == step_id:
                unadmitted.append(req)
        if freed_since:
            kv.reset_prefix_cache()
        if not unadmitted:
            return
        for req in reversed(unadmitted):  # prepended in reverse: the queue keeps their order
            req.num_computed_tokens = 0  # nothing of this step was written: nothing to cache
            self._free_blocks(req)
            req.status = _PREEMPTED
            req.num_output_placeholders = 0
            self.waiting.prepend(req)
            self._invalidated.append(req.request_id)
            self._taken_back.add(req.request_id)
        gone = set(unadmitted)
        self.running = [r for r in self.running if r not in gone]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (in-use blocks stay with their requests)."""
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        """A snapshot of the scheduler; prefix-cache and preemption counts are deltas since
        the previous call (the frontend's counters add them up)."""
        _, queries, hits = self.kv_cache_manager.take_stats()
        preemptions = self._num_preemptions
        self._num_preemptions = 0
        flops, self.pending_flops = self.pending_flops, 0.0
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=preemptions,
            step_counter=self._step_id,
            estimated_flops=flops,
            spec_decoding=self.spec.take_stats() if self.spec is not None else None,
            lora_running=_adapter_counts(self.running) if self.max_loras else None,
            lora_waiting=_adapter_counts(self.waiting) if self.max_loras else None,
            encoder_cache_usage=self.encoder.usage if self.encoder is not None else None,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the scheduler's books disagree (tests, debugging)."""
        kv = self.kv_cache_manager
        kv.check_invariants()
        waiting = list(self.waiting)
        if len(self.running) > self.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running > max_num_seqs")
        ids = ([r.request_id for r in self.running] + [r.request_id for r in waiting]
               + [r.request_id for r in self.waiting_for_grammar])
        if sorted(ids) != sorted(self.requests) or len(set(ids)) != len(ids):
            raise AssertionError("requests dict disagrees with running + waiting")
        for req in self.running:
            if req.status is not _RUNNING:
                raise AssertionError(f"{req!r} in running list")
            limit = req.num_tokens + req.num_output_placeholders
            if self.spec is not None:  # a step verifying drafts computes them too
                limit += self.spec.max_drafts
            if not 0 < req.num_computed_tokens <= limit:
                raise AssertionError(f"{req!r}: computed tokens out of range")
            slots = len(kv.get_block_ids(req.request_id)) * self.block_size
            if slots < req.num_computed_tokens:
                raise AssertionError(f"{req!r}: {slots} slots for its computed tokens")
        for req in waiting:
            if req.status not in (RequestStatus.WAITING, _PREEMPTED):
                raise AssertionError(f"{req!r} in waiting queue")
            if kv.has_blocks(req.request_id) or req.num_computed_tokens:
                raise AssertionError(f"{req!r}: waiting but holds blocks")


def _adapter_counts(requests: Iterable[Request]) -> dict[str, int]:
    """LoRA adapter name -> how many of `requests` run under it."""
    counts: dict[str, int] = {}
    for req in requests:
        if req.lora_request is not None:
            name = req.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts
