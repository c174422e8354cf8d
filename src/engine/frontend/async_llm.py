"""`ringserve.AsyncLLM`: the async (trio) frontend over engine-core processes.

What an HTTP handler talks to. `generate()` validates and tokenizes (long prompts off the event
loop), applies admission control, sends the request to a core through `DPLBAsyncMPClient`
(`AsyncMPClient` with routing over data-parallel cores), and yields RequestOutputs from the
request's collector.
One output-handler task receives every EngineCoreOutputs, processes it in chunks of
`RINGSERVE_OUTPUT_PROC_CHUNK_SIZE` with a checkpoint between chunks (so 1,000 streams never
starve other tasks), feeds the collectors and sends stop-string aborts back. Cancelling a
consumer aborts its request in the core within one step. A dead core fails every pending
`generate()` with EngineDeadError at once, and new requests fail fast.

Fault tolerance: a core that reports a fault (UNHEALTHY) has already ended its requests with
an error; the engine stays up, new requests fail fast with `EngineRecoveringError`, and
`apply_fault_instruction("retry" | "abort")` (or `submit_fault_instruction`, which runs it in
the background) tells the cores what to do; `fault_status()` reports every core's state.

Elastic data parallelism (`prepare_elastic_dp` / `commit_elastic_dp`, `scale_elastic_dp`):
`ringserve.engine.cluster.elastic_dp`.

Lifecycle: `async with AsyncLLM.from_engine_args(args) as llm:` starts the cores and the
handler in its own nursery; a server can instead `await nursery.start(llm.run)` to supervise it
in its root nursery. `shutdown()` stops everything.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import trio

from ringserve import envs
from ringserve.config import EngineConfig
from ringserve.engine.arg_utils import EngineArgs
from ringserve.engine.cluster.elastic_dp import AsyncElasticDPMethods
from ringserve.engine.errors import (
    RECOVERING_MESSAGE,
    EngineDeadError,
    EngineGenerateError,
    EngineRecoveringError,
    MaxQueuedTokensError,
    QueueOverflowError,
)
from ringserve.engine.frontend.async_client import AsyncMPClient
from ringserve.engine.frontend.attached_client import AttachedMPClient, Attachment
from ringserve.engine.frontend.collector import RequestOutputCollector
from ringserve.engine.frontend.dp_client import DPLBAsyncMPClient
from ringserve.engine.frontend.fault_tolerance import FaultStatusReport, check_instruction
from ringserve.engine.frontend.input_processor import InputProcessor, PromptType
from ringserve.engine.frontend.multimodal.renderer import RENDER_THREADS
from ringserve.engine.frontend.output_processor import OutputProcessor
from ringserve.engine.frontend.pooling import AsyncPoolingMethods
from ringserve.engine.frontend.rl_api import AsyncRLMethods
from ringserve.engine.metrics.metrics_reader import Metric
from ringserve.engine.metrics.stat_loggers import StatLoggerFactory, StatLoggerManager
from ringserve.engine.metrics.stats import IterationStats
from ringserve.engine.wire import FAULT_INSTRUCTION_METHOD, EngineCoreRequest
from ringserve.gpu.multimodal.features import ImageFeature
from ringserve.lora_request import LoRARequest
from ringserve.outputs import RequestOutput
from ringserve.pooling_params import PoolingParams
from ringserve.sampling_params import SamplingParams, default_sampling_params
from ringserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# Text prompts longer than this are tokenized in a worker thread.
_INLINE_TOKENIZE_CHARS = 2048


class AsyncLLM(AsyncRLMethods, AsyncElasticDPMethods, AsyncPoolingMethods):
    """An async engine for serving.

    Args:
        config: the engine configuration.
        executor: "default", or "null" / "null-mp" (no model; benchmarks and tests).
        stat_loggers: extra per-engine stat logger factories (besides the entry points).
        attach: be frontend `attach.client_index` of a scaled-out deployment, over cores
            that its supervisor started (`ringserve.engine.cluster.fleet`), instead of starting
            the cores.
    """

    def __init__(self, config: EngineConfig, executor: str = "default",
                 stat_loggers: list[StatLoggerFactory] | None = None,
                 attach: Attachment | None = None) -> None:
        self.config = config
        self.attach = attach
        self.tokenizer = load_tokenizer(config)
        self.input_processor = InputProcessor(
            config.model_config, self.tokenizer,
            config.structured_outputs_config.resolved_backend,
            pooling=config.pooler_config is not None, lora=config.lora_config,
            multimodal=config.multimodal_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        if attach is not None:
            self.output_processor.id_prefix = f"f{attach.client_index}."
        # The renderer pool: threads preprocessing images (`ringserve.engine.frontend.
        # multimodal.renderer`; the event loop never waits on an image).
        self.render_limiter = trio.CapacityLimiter(RENDER_THREADS)
        self.max_num_queued_reqs = config.frontend_config.max_num_queued_reqs
        self.max_num_queued_tokens = config.frontend_config.max_num_queued_tokens
        self._executor = executor
        self.client: AsyncMPClient | None = None
        self._ids = itertools.count()
        self._stop: trio.CancelScope | None = None
        self._errored: BaseException | None = None
        self._shut_down = False  # shutdown() was called: what dies from now on is its doing
        self._nursery_cm: Any = None
        self._nursery: trio.Nursery | None = None  # run()'s: background fault instructions
        self._stat_logger_factories = stat_loggers
        # Built by run() when stats are on (not --disable-log-stats); None otherwise.
        self.stat_loggers: StatLoggerManager | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        """Build the configuration once from `args` (cores start on `run` / `async with`)."""
        return cls(args.create_engine_config(), **kwargs)

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Start the cores, report ready, then run the output handler until shutdown.

        Returns when `shutdown()` is called; raises EngineDeadError if a core dies before
        that (after failing every pending request with it).
        """
        if self.attach is not None:
            attach = self.attach
            self.client = await AttachedMPClient.attach(self.config, attach.topology,
                                                        attach.client_index, attach.auth)
        else:
            self.client = await self._start_cores()
        obs = self.config.observability_config
        if not obs.disable_log_stats:
            engines = list(range(self.config.parallel_config.data_parallel_size))
            self.stat_loggers = StatLoggerManager(self.config, engines,
                                                  custom_factories=self._stat_logger_factories)
            # Every core is sized from the same config; vLLM reports the sum over them.
            self.stat_loggers.log_engine_initialized(self.client.num_blocks * len(engines))
        try:
            with trio.CancelScope() as self._stop:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    nursery.start_soon(self._watch_cores, nursery.cancel_scope)
                    if self.attach is not None and self.attach.topology.control_addr:
                        from ringserve.engine.cluster.elastic_cluster import serve_agent

                        nursery.start_soon(serve_agent, self)  # the supervisor scales
                    if self.stat_loggers is not None:
                        nursery.start_soon(self._log_stats_loop, self.stat_loggers,
                                           obs.log_stats_interval)
                    task_status.started()
                    await self._output_handler()
        finally:
            self._nursery = None
            self.client.shutdown()
            if self.stat_loggers is not None:
                self.stat_loggers.shutdown()
        if self._errored is not None:
            raise self._errored

    async def _start_cores(self) -> AsyncMPClient:
        """The client over freshly started cores (routing over them even for one: elastic
        scaling may add more); the image renderer warms up meanwhile."""
        create = partial(DPLBAsyncMPClient.create, self.config, self._executor)
        renderer = self.input_processor.renderer
        if renderer is None:
            return await create()
        client: AsyncMPClient | None = None
        failed: BaseException | None = None
        async with trio.open_nursery() as starting:
            starting.start_soon(partial(trio.to_thread.run_sync, renderer.warm_up,
                                        limiter=self.render_limiter))
            try:
                client = await create()
            except BaseException as exc:  # raised as is, not inside the nursery's group
                failed = exc
        if failed is not None or client is None:
            raise failed or RuntimeError("the engine cores did not start")
        return client

    async def __aenter__(self) -> AsyncLLM:
        self._nursery_cm = trio.open_nursery()
        nursery = await self._nursery_cm.__aenter__()
        try:
            await nursery.start(self._run_quietly)
        except BaseException as exc:
            try:
                await self._nursery_cm.__aexit__(type(exc), exc, exc.__traceback__)
            except BaseExceptionGroup as group:
                # The nursery wraps the start-up error alone in a group: raise the error itself.
                if list(group.exceptions) != [exc]:
                    raise
            raise
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        self.shutdown()
        result: bool | None = await self._nursery_cm.__aexit__(*exc)
        return result

    async def _run_quietly(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        # A dead engine has already failed every pending request with EngineDeadError and
        # fails new ones fast; letting it escape here would cancel the caller's `async with`
        # body instead.
        with contextlib.suppress(EngineDeadError):
            await self.run(task_status=task_status)

    def shutdown(self) -> None:
        """Stop the output handler and the cores; pending requests get EngineDeadError."""
        self._shut_down = True
        if self.client is not None and self.client.dead is None:
            self.client.mark_dead("the engine was shut down")
        self.output_processor.propagate_error(EngineDeadError("the engine was shut down"))
        if self._stop is not None:
            self._stop.cancel()

    @property
    def is_running(self) -> bool:
        """True while the engine can take requests."""
        return self.client is not None and self.client.dead is None

    @property
    def is_healthy(self) -> bool:
        """True while running and every engine core is healthy (not recovering)."""
        return self.client is not None and self.client.healthy

    @property
    def recovering(self) -> bool:
        """True while alive but no core can take requests (recovering from a fault)."""
        client = self.client
        return (client is not None and client.dead is None
                and not any(state.healthy for state in client.fault_states))

    @property
    def errored(self) -> bool:
        """True once the engine is dead."""
        return self.client is not None and self.client.dead is not None

    async def _watch_cores(self, scope: trio.CancelScope) -> None:
        assert self.client is not None  # set by run()
        await self.client.watch_cores(self._core_died)
        self._fail_all(EngineDeadError(self.client.dead or "an engine core died"))
        scope.cancel()

    def _core_died(self, index: int, reason: str | BaseException) -> None:
        """Fail the requests of a core whose process died (it is restarted, or the engine
        dies with it), or that hung (`reason` is then the error they fail with)."""
        client = self.client
        assert client is not None
        error = reason if isinstance(reason, BaseException) else EngineDeadError(reason)
        owned = [rid for rid in self.output_processor.request_states
                 if client.engine_of(rid) in (index, None)]
        self.output_processor.fail_requests(owned, error)
        for rid in owned:
            client.request_finished(rid)

    def _fail_all(self, error: EngineDeadError) -> None:
        # After shutdown() a core's death, or the output handler meeting the client it marked
        # dead, is the shutdown itself: `run` returns. They can still be seen when they were
        # woken in the same scheduling batch as the shutdown, before its cancellation (a stop
        # of the whole process group used to end the core at that very moment).
        if not self._shut_down:
            self._errored = self._errored or error
        if self.stat_loggers is not None:
            self.stat_loggers.record_health(False)
        self.output_processor.propagate_error(error)

    # -- output handling -----------------------------------------------------------------------

    async def _output_handler(self) -> None:
        client = self.client
        assert client is not None  # set by run()
        processor = self.output_processor
        chunk = envs.output_proc_chunk_size()
        stat_loggers = self.stat_loggers
        try:
            while True:
                batch = await client.get_output()
                outputs = batch.outputs
                iteration_stats = IterationStats() if stat_loggers is not None else None
                for start in range(0, len(outputs), chunk):
                    # Yield before every chunk: get_output() does not yield when batches are
                    # already queued, so without this a backlog would be folded in one go.
                    await trio.lowlevel.checkpoint()
                    processed = processor.process_outputs(outputs[start:start + chunk],
                                                          batch.timestamp, iteration_stats,
                                                          batch.weight_version)
                    if processed.reqs_to_abort:
                        await client.abort_requests(processed.reqs_to_abort)
                    for out in outputs[start:start + chunk]:
                        if out.finish_reason is not None:
                            client.request_finished(out.request_id)
                if stat_loggers is not None:
                    stat_loggers.record(batch.scheduler_stats, iteration_stats,
                                        batch.engine_index)
                    renderer = self.input_processor.renderer
                    if renderer is not None:
                        stat_loggers.record_mm_cache(*renderer.take_cache_stats())
        except EngineDeadError as exc:
            # Fail every pending request now; run() re-raises after the nursery has closed
            # (raising here would arrive wrapped in an exception group).
            self._fail_all(exc)
            if self._stop is not None:
                self._stop.cancel()

    @staticmethod
    async def _log_stats_loop(stat_loggers: StatLoggerManager, interval: float) -> None:
        while True:
            await trio.sleep(interval)
            stat_loggers.log()

    # -- requests ------------------------------------------------------------------------------

    def check_admission(self, num_requests: int, num_prompt_tokens: int) -> None:
        """Refuse a request that would exceed the frontend's queue limits.

        Raises:
            QueueOverflowError: more than `max_num_queued_reqs` requests would be in flight.
            MaxQueuedTokensError: more than `max_num_queued_tokens` prompt tokens would wait
                for prefill.
        """
        limit = self.max_num_queued_reqs
        in_flight = self.output_processor.get_num_unfinished_requests()
        if limit is not None and in_flight + num_requests > limit:
            raise QueueOverflowError(
                f"{in_flight} requests in flight; max_num_queued_reqs is {limit}")
        token_limit = self.max_num_queued_tokens
        queued = self.output_processor.num_prefill_tokens
        if token_limit is not None and queued + num_prompt_tokens > token_limit:
            raise MaxQueuedTokensError(
                f"{queued} prompt tokens wait for prefill and this request adds "
                f"{num_prompt_tokens}; max_num_queued_tokens is {token_limit}")

    async def _process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       priority: int, data_parallel_rank: int | None,
                       pooling_params: PoolingParams | None = None,
                       lora_request: LoRARequest | None = None,
                       mm_features: list[ImageFeature] | None = None,
                       ) -> tuple[EngineCoreRequest, str | None]:
        process = self.input_processor.process

        def run() -> tuple[EngineCoreRequest, str | None]:
            return process(request_id, prompt, params, priority=priority,
                           data_parallel_rank=data_parallel_rank,
                           pooling_params=pooling_params, lora_request=lora_request,
                           mm_features=mm_features)

        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            # Images are loaded and preprocessed in the renderer's threads, never here.
            return await trio.to_thread.run_sync(run, limiter=self.render_limiter)
        if isinstance(prompt, str) and len(prompt) > _INLINE_TOKENIZE_CHARS:
            return await trio.to_thread.run_sync(run)
        return run()

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          *, priority: int = 0, data_parallel_rank: int | None = None,
                          pooling_params: PoolingParams | None = None,
                          collector: Any = None,
                          lora_request: LoRARequest | None = None,
                          mm_features: list[ImageFeature] | None = None,
                          ) -> RequestOutputCollector:
        """Validate, admit and send a request; returns its collector.

        `request_id` is the caller's: it is echoed in every output but need not be unique.
        Inside, the request (and each child of an n > 1 request) travels under an internal
        id unique to it (`collector.handle`), so no other request's abort or disconnect can
        touch it.

        A pooling request (`pooling_params`, `ringserve.engine.frontend.pooling`) may bring
        its own `collector`.

        Raises:
            TypeError: an argument of the wrong type (naming it).
            EngineDeadError: the engine is dead.
            ValueError: the prompt or parameters are invalid.
            QueueOverflowError, MaxQueuedTokensError: admission control refused it.
        """
        client = self._live_client()
        request, text = await self._process(request_id, prompt, params, priority,
                                            data_parallel_rank, pooling_params, lora_request,
                                            mm_features)
        client = self._live_client()  # it may have died while tokenizing
        client.check_accepting()
        self.check_admission(params.n, params.n * len(request.prompt_token_ids))
        mailbox: RequestOutputCollector = (RequestOutputCollector(params.output_kind)
                                           if collector is None else collector)
        handle, children = self.output_processor.admit(request, text, queue=mailbox)
        mailbox.handle = handle
        try:
            for child in children:
                await client.add_request(child)
        except BaseException:
            # Not sent (its core is restarting, the engine died, a bad data_parallel_rank):
            # stop tracking every child (which gives back their admission counts), and abort
            # the ones that did reach a core.
            self._abort_now([handle])
            raise
        return mailbox

    def _live_client(self) -> AsyncMPClient:
        client = self.client
        if client is None:
            raise EngineDeadError("the engine is not running (use `async with` or run())")
        if client.dead is not None:
            raise EngineDeadError(client.dead)
        return client

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       data_parallel_rank: int | None = None,
                       lora_request: LoRARequest | None = None,
                       mm_features: list[ImageFeature] | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (delta, cumulative or final-only per output_kind), under
        `lora_request`'s adapter when given (`--enable-lora`); `mm_features`: a token
        prompt's images, rendered (`render_chat_images`).

        Leaving the loop early, or cancelling the consuming task, aborts the request.

        Raises:
            EngineDeadError: the engine died (now or before).
            EngineGenerateError: this request failed in the engine.
            ValueError, QueueOverflowError, MaxQueuedTokensError: as `add_request`.
        """
        params = sampling_params or default_sampling_params(
            self.config.model_config.generation_defaults)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        collector = await self.add_request(rid, prompt, params, priority=priority,
                                           data_parallel_rank=data_parallel_rank,
                                           lora_request=lora_request, mm_features=mm_features)
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                failed = [c for c in output.outputs if c.finish_reason == "error"]
                if failed:
                    finished = True
                    if failed[0].stop_reason == RECOVERING_MESSAGE:
                        raise EngineRecoveringError(f"request {rid!r}: {RECOVERING_MESSAGE}")
                    raise EngineGenerateError(f"request {rid!r} failed: {failed[0].stop_reason}")
                yield output
        finally:
            if not finished:
                self._abort_now([collector.handle])

    def _abort_now(self, request_ids: list[str]) -> None:
        """Abort without awaiting (works inside a cancelled scope)."""
        core_ids = self.output_processor.abort_requests(request_ids)
        client = self.client
        if core_ids and client is not None and client.dead is None:
            client.abort_requests_nowait(core_ids)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests by their ids (every in-flight request with that id); their streams
        end with finish reason "abort"."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        processor = self.output_processor
        core_ids = processor.abort_requests(processor.handles_of(ids), notify=True)
        client = self.client
        if core_ids and client is not None and client.dead is None:
            await client.abort_requests(core_ids)

    async def call_utility(self, method: str, *args: Any) -> list[Any]:
        """Call a utility on every engine core; results in core order."""
        results = await self._live_client().call_utility(method, *args)
        if self.stat_loggers is not None and method in ("sleep", "wake_up"):
            level = (int(args[0]) if args else 1) if method == "sleep" else 0
            self.stat_loggers.record_sleep_state(level)
        return results

    # -- fault tolerance -------------------------------------------------------------------------

    def fault_status(self) -> FaultStatusReport:
        """Every core's fault-tolerance state (a snapshot)."""
        if self.client is None:
            raise EngineDeadError("the engine is not running (use `async with` or run())")
        return FaultStatusReport.of(self.client.fault_states)

    async def apply_fault_instruction(self, instruction: str,
                                      params: dict[str, Any] | None = None,
                                      ft_request_id: str | None = None) -> str:
        """Tell every core to `retry` (rebuild its workers) or `abort` (shut down); returns
        when they have done it. A healthy core takes `retry` as a no-op.

        Args:
            instruction: "retry" or "abort".
            params: none are defined; must be empty.
            ft_request_id: the instruction's id (default: a fresh one).

        Returns:
            The instruction's id (the cores report it as `last_ft_request_id`).

        Raises:
            ValueError: an unknown instruction or parameters, or a core's retry failed (the
                message says why; the core stays unhealthy and waits for another).
            EngineDeadError: the engine is dead (not after `abort`, which kills it).
        """
        check_instruction(instruction, params)
        rid = ft_request_id or f"ft-{uuid.uuid4().hex}"
        client = self._live_client()
        try:
            # A core being restarted (its process died) comes back healthy by itself: a retry
            # goes to the others.
            await client.call_utility(FAULT_INSTRUCTION_METHOD, instruction, rid,
                                      skip_restarting=instruction == "retry")
        except EngineDeadError:
            if instruction != "abort":
                raise
        return rid

    def submit_fault_instruction(self, instruction: str,
                                 params: dict[str, Any] | None = None) -> str:
        """Start `apply_fault_instruction` in the background; returns its id at once.

        Raises:
            ValueError: an unknown instruction or parameters.
            EngineDeadError: the engine is not running.
        """
        check_instruction(instruction, params)
        nursery = self._nursery
        if nursery is None:
            raise EngineDeadError("the engine is not running (use `async with` or run())")
        self._live_client()
        rid = f"ft-{uuid.uuid4().hex}"
        nursery.start_soon(self._apply_in_background, instruction, rid)
        return rid

    async def _apply_in_background(self, instruction: str, ft_request_id: str) -> None:
        # The cores publish the outcome (status, ft_error) themselves; this only logs it.
        # A core being restarted (its process died) takes no instruction and answers
        # EngineRecoveringError; it comes back by itself. That must not end the engine.
        try:
            await self.apply_fault_instruction(instruction, ft_request_id=ft_request_id)
        except (ValueError, EngineDeadError, EngineRecoveringError) as exc:
            logger.error("fault instruction %s (%s) failed: %s", instruction, ft_request_id, exc)

    def get_metrics(self) -> list[Metric]:
        """A snapshot of this engine's Prometheus series (empty while stats are off)."""
        return self.stat_loggers.get_metrics() if self.stat_loggers is not None else []

    async def reset_prefix_cache(self) -> None:
        """Drop cached prefix blocks on every core."""
        await self.call_utility("reset_prefix_cache")

    def get_tokenizer(self) -> Any:
        """The tokenizer."""
        return self.tokenizer
