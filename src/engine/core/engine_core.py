"""EngineCore: one engine's step, in process (the busy loop and sockets live in core_proc.py).

`step()` = schedule -> execute_model(non_block) -> result -> update_from_output, returning the
EngineCoreOutputs per frontend client. With async scheduling (`max_concurrent_batches` 2),
`step_with_batch_queue()` schedules and submits step N+1 before waiting for step N, so the CPU
work of scheduling overlaps the model; the scheduler's placeholders keep the books right.
Requests and aborts are applied between steps by the caller (the busy loop or a client).
Utility calls (`call_utility`) reach the methods named in `UTILITY_METHODS`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec

from ringserve.config import EngineConfig
from ringserve.engine.core.pause_sleep import PauseMode, PauseSleepMixin
from ringserve.engine.core.weight_sync import WEIGHT_SYNC_UTILITIES, WeightSyncMixin
from ringserve.engine.metrics.expert_load import WORKER_METHOD as EXPERT_LOAD_METHOD
from ringserve.engine.metrics.expert_load import ExpertLoadPuller
from ringserve.engine.metrics.flops import ModelFlops
from ringserve.engine.sched.scheduler import Scheduler
from ringserve.engine.structured.manager import AllowAll, StructuredOutputManager, draft_rows
from ringserve.engine.wire import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from ringserve.gpu.executor.base import Executor
from ringserve.gpu.executor.errors import WorkerTimeoutError
from ringserve.gpu.executor.select import executor_class as select_executor
from ringserve.gpu.multimodal.scheduling import encoder_books
from ringserve.gpu.spec_decode.scheduling import SpecScheduling
from ringserve.gpu.weights import snapshot_dirs as weight_snapshot
from ringserve.gpu.wire import GrammarOutput, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# The grammar row of a request that finished since its step was scheduled.
_FINISHED = AllowAll()

UTILITY_METHODS = frozenset({
    "sleep", "wake_up", "is_sleeping", "hold_new_requests", "release_new_requests",
    "get_step_timings", "get_weight_version", "set_weight_version", "pause", "resume", "is_paused",
    "reset_prefix_cache", "get_stats", "get_num_blocks", "ping", "remove_lora",
    *WEIGHT_SYNC_UTILITIES,
})


class EngineCore(WeightSyncMixin, PauseSleepMixin):
    """Scheduler + executor for one engine (one data-parallel rank).

    Args:
        config: the engine configuration.
        executor_class: override the executor (tests use fakes); default by config.
        engine_index: this core's data-parallel rank.
        wake: called from another thread when a grammar has compiled (the busy loop may be
            blocked waiting for input).

    Raises:
        ValueError: the KV cache cannot hold even one block, or the config is unusable.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor_class: type[Executor] | None = None,
        engine_index: int = 0,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.engine_index = engine_index
        if config.weight_transfer_config is not None:
            weight_snapshot.cleanup_stale()  # left by cores that were killed
        # Grammars compile on its threads; `wake` rouses an idle busy loop when one is done.
        self.structured = StructuredOutputManager(config, wake)
        # A submitted step whose bitmask waits for the step before it (async scheduling).
        self._grammar_pending: SchedulerOutput | None = None
        self._executor_class = executor_class or select_executor(config)
        self.executor, self.num_blocks = self._build_executor(None)
        self.scheduler = self._build_scheduler()
        # A step whose future is not done in this many seconds is an engine fault.
        self.step_timeout = config.fault_tolerance_config.execute_model_timeout_s
        self.batch_queue_size = self.executor.max_concurrent_batches
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput]] = deque()
        # Seconds spent per phase since the last get_step_timings() (engine-overhead benchmark).
        self.timings: dict[str, float] = dict.fromkeys(("schedule", "execute", "update"), 0.0)
        self.timings["steps"] = 0.0
        self.timings["skipped"] = 0.0  # steps the workers skipped for a pause (step_hold.py)
        self._timings_since = time.perf_counter()
        self.weight_version: str | None = None
        # Outputs of steps drained by a utility (a weight swap), sent by the next step call.
        self._stashed: list[dict[int, EngineCoreOutputs]] = []
        self._update_open = False  # a weight-update round is open (ringserve.engine.core.weight_sync)
        self._round_snapshot = False
        self._snapshot_current = False
        self.pause_mode: PauseMode | None = None
        # A pause on its way from the input thread: nothing is scheduled, and the workers
        # skip the steps they read (`ringserve.gpu.executor.step_hold`), until it is applied.
        self._hold = False
        self._hold_lock = threading.Lock()
        self._held: list[EngineCoreRequest] = []  # requests that arrived while paused/asleep
        self.sleep_level = 0
        obs = config.observability_config
        # Analytic FLOPs per step, shipped to the frontend in SchedulerStats.
        self.flops = (ModelFlops.from_config(config)
                      if obs.enable_mfu_metrics and not obs.disable_log_stats else None)
        # Pulls the workers' expert-load counts now and then, for SchedulerStats.
        self.expert_load = ExpertLoadPuller.for_config(config, time.monotonic())

    def _build_executor(self, num_blocks: int | None,
                        config: EngineConfig | None = None) -> tuple[Executor, int]:
        """Start an executor (with `config`, default the engine's) and allocate its KV cache
        (`num_blocks`, or as many as fit)."""
        config = config or self.config
        executor = self._executor_class(config)
        try:
            fit = executor.determine_num_blocks()
            if fit < 2:
                raise ValueError(
                    f"KV cache too small: {fit} blocks of {config.cache_config.block_size} "
                    "tokens (at least 2 needed); raise --kv-cache-memory or "
                    "--gpu-memory-utilization"
                )
            if num_blocks is not None and fit < num_blocks:
                raise ValueError(f"the new workers hold {fit} KV blocks, fewer than the "
                                 f"{num_blocks} the engine was started with")
            num_blocks = fit if num_blocks is None else num_blocks
            executor.initialize_kv_cache(num_blocks)
        except BaseException:
            executor.shutdown()
            raise
        return executor, num_blocks

    def _build_scheduler(self) -> Scheduler:
        config = self.config
        return Scheduler(
            config.scheduler_config, config.cache_config, self.num_blocks,
            eos_token_ids=config.model_config.eos_token_ids,
            log_stats=not config.observability_config.disable_log_stats,
            engine_index=self.engine_index,
            structured=self.structured,
            spec=SpecScheduling.from_config(config.speculative_config),
            max_loras=config.lora_config.max_loras if config.lora_config is not None else 0,
            encoder=encoder_books(config.multimodal_config),
        )

    # -- faults --------------------------------------------------------------------------------

    def fail_all_requests(self, error: str) -> dict[int, EngineCoreOutputs]:
        """Engine fault: forget the steps in flight and end every request (held ones too)
        with finish reason ERROR and `error`; every block is free afterwards."""
        self.batch_queue.clear()
        self._grammar_pending = None
        self._release_hold()
        outputs = self.scheduler.abort_all(FinishReason.ERROR, error=error)
        held, self._held = self._held, []
        for request in held:
            failed = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR,
                                      stop_reason=error)
            client = outputs.setdefault(request.client_index,
                                        EngineCoreOutputs(engine_index=self.engine_index))
            client.outputs.append(failed)
        return outputs

    def rebuild_executor(self) -> None:
        """Recover from a fault: replace the executor (new workers and rings, weights loaded,
        a KV cache of the same number of blocks) and the scheduler (same config, no
        requests, empty prefix cache). Call `fail_all_requests` first.

        Raises:
            Exception: the new executor could not be built (the old one is already gone).
        """
        self.batch_queue.clear()
        self._grammar_pending = None
        self._release_hold()
        self.executor.shutdown()
        # New workers load the last complete weights from a trainer when a snapshot holds
        # them (ringserve.gpu.weights.snapshot), else the start-up checkpoint.
        config, version = self.restart_config()
        self.executor, _ = self._build_executor(self.num_blocks, config)
        self.scheduler = self._build_scheduler()
        self.pause_mode = None
        self.sleep_level = 0
        self._holding_new = False
        self._held = []
        self.weight_version = version
        self._update_open = False

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one that can never run, or cannot be added (a duplicate id),
        finishes with an ERROR output and the engine keeps serving.

        While paused or asleep, new requests are held and queued on `resume()` / `wake_up()`.
        """
        if self.holds_new_requests():
            self._held.append(request)
            return
        self._add_to_scheduler(request)

    def _add_to_scheduler(self, request: EngineCoreRequest) -> None:
        try:
            self.scheduler.add_request(request)
        except Exception as exc:
            # Tied to this request alone (a duplicate id, a value the scheduler cannot take):
            # it ends with finish reason ERROR and the engine keeps serving.
            logger.warning("engine core %d: request %r refused: %s", self.engine_index,
                           request.request_id, exc)
            self.scheduler.reject_request(request, f"{type(exc).__name__}: {exc}")

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests (unknown ids are ignored); their blocks are freed now."""
        if self._held:
            gone = set(request_ids)
            self._held = [r for r in self._held if r.request_id not in gone]
        if request_ids:
            self.scheduler.finish_requests(request_ids, FinishReason.ABORT)

    def abort_client(self, client_index: int) -> None:
        """Abort every request of frontend `client_index` (its process died)."""
        ids = [rid for rid, req in self.scheduler.requests.items()
               if req.client_index == client_index]
        ids.extend(r.request_id for r in self._held if r.client_index == client_index)
        self.abort_requests(ids)

    def has_work(self) -> bool:
        """True while there is something to schedule, in flight, or to report."""
        # Finished ids for the workers count only while scheduling is allowed (they go out
        # with the next step; `_may_schedule` covers them): paused, they wait, not spin.
        return (self._may_schedule() or bool(self.batch_queue) or bool(self._stashed)
                or self.scheduler.has_pending_outputs())

    # -- steps ---------------------------------------------------------------------------------

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """One synchronous step; returns (outputs per client, whether the model ran)."""
        if self._stashed:
            return self._stashed.pop(0), False
        if not self._may_schedule():
            return self._stamp(self.scheduler.take_pending_outputs()), False
        timings, t0 = self.timings, time.perf_counter()
        scheduler_output = self._schedule()
        if not _worth_sending(scheduler_output):
            return self._stamp(self.scheduler.take_pending_outputs()), False
        t1 = time.perf_counter()
        future = self.executor.execute_model(scheduler_output, non_block=True)
        if scheduler_output.grammar_req_ids:
            self._send_grammar(scheduler_output)  # while the forward runs
        model_output = self._result(future)
        t2 = time.perf_counter()
        outputs = self._apply(scheduler_output, model_output)
        timings["schedule"] += t1 - t0
        timings["execute"] += t2 - t1
        timings["update"] += time.perf_counter() - t2
        timings["steps"] += 1
        return self._stamp(self._with_expert_load(outputs)), True

    def dummy_pass(self) -> None:
        """This core's part of a lockstep step without a batch (`ringserve.engine.core.dp_wave`):
        every worker takes part in the MoE layers' exchanges with no token.

        Raises:
            ExecutorError: a worker died or failed (an engine fault).
        """
        self.executor.collective_rpc("dummy_pass", timeout=self.step_timeout)

    def _stamp(self, outputs: dict[int, EngineCoreOutputs]) -> dict[int, EngineCoreOutputs]:
        """Mark each batch with the weight version its tokens were generated with."""
        version = self.weight_version
        if version is not None:
            for batch in outputs.values():
                batch.weight_version = version
        return outputs

    def _with_expert_load(self, outputs: dict[int, EngineCoreOutputs]
                          ) -> dict[int, EngineCoreOutputs]:
        """After a step: the expert load since the previous pull, when one is due, in the
        step's stats (`ExpertLoadPuller.add_to`)."""
        if self.expert_load is not None:
            self.expert_load.add_to(
                outputs.values(), self.executor, not self.scheduler.has_unfinished_requests(),
                lambda: self._worker_call(EXPERT_LOAD_METHOD, (), self.step_timeout)[0])
        return outputs

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        if self.flops is not None:
            self.scheduler.pending_flops += self.flops.step_flops(scheduler_output)
        return scheduler_output

    def step_with_batch_queue(self) -> tuple[dict[int, EngineCoreOutputs] | None, bool]:
        """Keep up to `batch_queue_size` steps in flight; returns outputs of the oldest.

        Returns (None, True) when a step was submitted and the queue is not full yet, so the
        caller can take new requests before waiting for the oldest step.
        """
        if self._stashed:
            return self._stashed.pop(0), False
        queue, timings = self.batch_queue, self.timings
        submitted = False
        if len(queue) < self.batch_queue_size and self._may_schedule():
            t0 = time.perf_counter()
            scheduler_output = self._schedule()
            timings["schedule"] += time.perf_counter() - t0
            if _worth_sending(scheduler_output):
                future = self.executor.execute_model(scheduler_output, non_block=True)
                queue.appendleft((future, scheduler_output))
                submitted = True
                if scheduler_output.grammar_req_ids:
                    if len(queue) == 1:
                        self._send_grammar(scheduler_output)
                    else:  # its matchers need the older step's tokens first
                        self._grammar_pending = scheduler_output
                if len(queue) < self.batch_queue_size and not queue[-1][0].done():
                    return None, True
        if not queue:
            return self._stamp(self.scheduler.take_pending_outputs()), submitted
        future, scheduler_output = queue.pop()
        t1 = time.perf_counter()
        model_output = self._result(future)
        t2 = time.perf_counter()
        outputs = self._apply(scheduler_output, model_output)
        self._flush_grammar()
        timings["execute"] += t2 - t1
        timings["update"] += time.perf_counter() - t2
        timings["steps"] += 1
        return self._stamp(self._with_expert_load(outputs)), True

    def _apply(self, scheduler_output: SchedulerOutput,
               model_output: ModelRunnerOutput) -> dict[int, EngineCoreOutputs]:
        """Book a step's output: its tokens, or, for a step the workers skipped (a pause
        came), take the step back; the outputs per client."""
        if model_output.skipped:
            self.timings["skipped"] += 1
            self.scheduler.rollback_step(scheduler_output, model_output)
            return self.scheduler.take_pending_outputs()
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def _result(self, future: Future[ModelRunnerOutput]) -> ModelRunnerOutput:
        """A step's output; waiting longer than `execute_model_timeout_s` is a fault.

        Raises:
            TimeoutError: the step did not finish in time (a hung worker).
        """
        try:
            return future.result(self.step_timeout)
        except TimeoutError:
            if future.done():
                raise  # the step itself raised TimeoutError
            raise TimeoutError(f"execute_model did not finish within {self.step_timeout:g} s "
                               "(--execute-model-timeout-s)") from None

    def _send_grammar(self, scheduler_output: SchedulerOutput) -> None:
        """Compute the step's bitmask for its constrained rows and hand it to the workers;
        a request whose grammar allows no token ends with an error."""
        requests = self.scheduler.requests
        ids = scheduler_output.grammar_req_ids
        grammars: list[Any] = [requests[rid].grammar if rid in requests else _FINISHED
                               for rid in ids]
        drafted = scheduler_output.spec_token_ids
        if drafted and any(rid in drafted for rid in ids):
            ids, grammars = draft_rows(ids, grammars, drafted, _FINISHED)
        bitmask, dead = self.structured.bitmask(grammars)
        for row in dead:
            req = requests.get(ids[row])
            if req is not None:
                req.error = f"request {req.request_id!r}: {req.grammar.error}"
                self.scheduler.finish_requests(req.request_id, FinishReason.ERROR, notify=True)
        self.executor.sample_tokens(GrammarOutput(scheduler_output.step_id, ids, bitmask))

    def _flush_grammar(self) -> None:
        pending, self._grammar_pending = self._grammar_pending, None
        if pending is not None:
            self._send_grammar(pending)

    def _worker_call(self, method: str, args: tuple[Any, ...],
                     timeout: float | None) -> list[Any]:
        """`collective_rpc` between steps (returns the results in rank order); workers that
        do not answer within `timeout` (the execute-model timeout: None waits as long as it
        takes) are an engine fault.

        Raises:
            WorkerTimeoutError: not every worker answered in time.
            ExecutorError: a worker died or raised (an engine fault too).
        """
        try:
            return self.executor.collective_rpc(method, args, timeout=timeout)
        except TimeoutError:
            if timeout is None:
                raise
            raise WorkerTimeoutError(
                f"{method} did not finish on every worker within {timeout:g} s "
                "(--execute-model-timeout-s)") from None

    def _may_schedule(self) -> bool:
        return (self.scheduler.has_requests() and self.pause_mode not in ("keep", "abort")
                and not self.sleep_level and not self._hold)

    def drain(self) -> dict[int, EngineCoreOutputs]:
        """Wait for every step in flight and apply it (before pausing or shutting down)."""
        merged: dict[int, EngineCoreOutputs] = {}
        while self.batch_queue:
            future, scheduler_output = self.batch_queue.pop()
            outputs = self._apply(scheduler_output, future.result())
            self._flush_grammar()
            for client, outs in outputs.items():
                if client in merged:
                    merged[client].outputs.extend(outs.outputs)
                else:
                    merged[client] = outs
        return self._stamp(merged)

    # -- utilities -----------------------------------------------------------------------------

    def call_utility(self, method: str, args: list[Any]) -> Any:
        """Run a utility method by name (see UTILITY_METHODS).

        Raises:
            ValueError: an unknown method or bad arguments.
        """
        if method not in UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}; known: {sorted(UTILITY_METHODS)}")
        return getattr(self, method)(*args)

    def ping(self) -> str:
        """Liveness check through the utility channel."""
        return "pong"

    def get_step_timings(self) -> dict[str, float]:
        """Seconds per phase (schedule, execute, update, output), steps (and steps the
        workers skipped for a pause) and elapsed wall time since the last call."""
        now = time.perf_counter()
        timings = dict(self.timings)
        timings["elapsed"] = now - self._timings_since
        self._timings_since = now
        for key in self.timings:
            self.timings[key] = 0.0
        return timings

    def get_weight_version(self) -> str | None:
        """The opaque weight version set by the operator (None until set)."""
        return self.weight_version

    def set_weight_version(self, version: str | None) -> None:
        """Record an opaque weight version (as vLLM's `_weight_version`)."""
        if version is not None and not isinstance(version, str):
            raise ValueError(f"weight version: expected a string or None, got {version!r}")
        self.weight_version = version

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block not in use; False when some are still in use."""
        return self.scheduler.reset_prefix_cache()

    def remove_lora(self, identity: str) -> bool:
        """An adapter unloaded (`/v1/unload_lora_adapter`): every worker drops it from its
        slot and memory once the requests running on it have finished (`ringserve.gpu.lora.
        manager`). False when LoRA is off."""
        if self.config.lora_config is None:
            return False
        self._worker_call("remove_lora", (identity,), self.step_timeout)
        return True

    def get_stats(self) -> dict[str, Any]:
        """The scheduler's current statistics (SchedulerStats fields as a dict)."""
        stats: SchedulerStats = self.scheduler.make_stats()
        return msgspec.structs.asdict(stats)

    def get_num_blocks(self) -> int:
        """The number of KV cache blocks."""
        return self.num_blocks

    def shutdown(self) -> None:
        """Stop the executor and its workers; idempotent."""
        self.batch_queue.clear()
        self._grammar_pending = None
        self._release_hold()
        self.executor.shutdown()
        self.structured.shutdown()
        self.remove_snapshot()


def _worth_sending(scheduler_output: SchedulerOutput) -> bool:
    """A step goes to the workers when it computes tokens or tells them to drop requests."""
    return bool(scheduler_output.total_num_scheduled_tokens or scheduler_output.finished_req_ids
                or scheduler_output.preempted_req_ids)

