"""LLMEngine: the synchronous frontend over one engine core (used by the offline `LLM`).

add_request (validate, tokenize, fan out n > 1) -> the core client; step() -> the core's next
outputs -> the output processor -> RequestOutputs; stop-string hits are aborted in the core.
"""

from __future__ import annotations

import time
from typing import Any

from ringserve import envs
from ringserve.config import EngineConfig
from ringserve.engine.arg_utils import EngineArgs
from ringserve.engine.frontend.core_client import EngineCoreClient, InprocClient
from ringserve.engine.frontend.input_processor import InputProcessor, PromptType
from ringserve.engine.frontend.output_processor import OutputProcessor, ProcessedOutputs
from ringserve.engine.metrics.metrics_reader import Metric
from ringserve.engine.metrics.stat_loggers import StatLoggerManager
from ringserve.engine.metrics.stats import IterationStats
from ringserve.engine.wire import EngineCoreRequest
from ringserve.gpu.executor.base import Executor
from ringserve.lora_request import LoRARequest
from ringserve.outputs import RequestOutput
from ringserve.sampling_params import SamplingParams
from ringserve.tokenizer import load_tokenizer


def _make_client(config: EngineConfig, executor_class: type[Executor] | None) -> EngineCoreClient:
    """A core in its own process (the default), or in this one (tests, executor overrides)."""
    if executor_class is None and envs.enable_multiprocessing():
        from ringserve.engine.frontend.mp_client import SyncMPClient

        return SyncMPClient(config)
    return InprocClient(config, executor_class)


class LLMEngine:
    """A synchronous engine: add requests, call `step()` until they finish.

    Args:
        config: the engine configuration.
        executor_class: override the executor (tests and benchmarks).
        client: use this core client; default: a core process (SyncMPClient) unless
            RINGSERVE_ENABLE_MULTIPROCESSING=0 or an executor class is given (in-process).
    """

    def __init__(
        self,
        config: EngineConfig,
        executor_class: type[Executor] | None = None,
        client: EngineCoreClient | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.input_processor = InputProcessor(
            config.model_config, self.tokenizer,
            config.structured_outputs_config.resolved_backend,
            pooling=config.pooler_config is not None, lora=config.lora_config,
            multimodal=config.multimodal_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = client if client is not None else _make_client(config, executor_class)
        obs = config.observability_config
        self.stat_loggers = None if obs.disable_log_stats else StatLoggerManager(config)
        if self.stat_loggers is not None:
            self.stat_loggers.log_engine_initialized(self.engine_core.num_blocks)
        self._log_interval = obs.log_stats_interval
        self._next_log_time = time.monotonic() + self._log_interval

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> LLMEngine:
        """Build the config from `args`, then the engine."""
        return cls(args.create_engine_config(), **kwargs)

    def get_tokenizer(self) -> Any:
        """The tokenizer used for prompts and outputs."""
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate, tokenize and queue a request (n > 1 becomes n child requests), under
        `lora_request`'s adapter when given.

        Raises:
            ValueError: the prompt or the parameters are invalid (nothing is queued).
        """
        request, text = self.input_processor.process(request_id, prompt, params,
                                                     arrival_time=arrival_time, priority=priority,
                                                     lora_request=lora_request)
        self.add_processed_request(request, text)

    def add_processed_request(self, request: EngineCoreRequest, text: str | None) -> str:
        """Queue a request `input_processor.process` built (n > 1 fans out to children).

        Returns:
            Its internal handle: the core sees it (and its children) under unique ids, so a
            user id shared by two requests never mixes them up.
        """
        processor = self.output_processor
        handle, children = processor.admit(request, text)
        try:
            for child in children:
                self.engine_core.add_request(child)
        except BaseException:
            self.engine_core.abort_requests(processor.abort_requests([handle]))
            raise
        return handle

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests by their user ids (n > 1 parents abort all children)."""
        processor = self.output_processor
        core_ids = processor.abort_requests(processor.handles_of(request_ids))
        self.engine_core.abort_requests(core_ids)

    def step(self) -> list[RequestOutput]:
        """Run the core until it produces outputs; returns the RequestOutputs they make."""
        return self.step_outputs().request_outputs

    def step_outputs(self) -> ProcessedOutputs:
        """`step`, with the pooling requests' answers too (`ProcessedOutputs`)."""
        outputs = self.engine_core.get_output()
        stat_loggers = self.stat_loggers
        iteration_stats = IterationStats() if stat_loggers is not None else None
        processed = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp,
                                                          iteration_stats, outputs.weight_version)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        if stat_loggers is not None:
            stat_loggers.record(outputs.scheduler_stats, iteration_stats, outputs.engine_index)
            renderer = self.input_processor.renderer
            if renderer is not None:
                stat_loggers.record_mm_cache(*renderer.take_cache_stats())
            if iteration_stats is not None and iteration_stats.iteration_timestamp >= (
                    self._next_log_time):
                self._next_log_time = iteration_stats.iteration_timestamp + self._log_interval
                stat_loggers.log()
        return processed

    def get_metrics(self) -> list[Metric]:
        """A snapshot of this engine's Prometheus series (empty while stats are off)."""
        return self.stat_loggers.get_metrics() if self.stat_loggers is not None else []

    def has_unfinished_requests(self) -> bool:
        """True while any request is in flight."""
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        """Number of (child) requests in flight."""
        return self.output_processor.get_num_unfinished_requests()

    def call_utility(self, method: str, *args: Any) -> Any:
        """Call an engine-core utility (reset_prefix_cache, pause, ...)."""
        result = self.engine_core.call_utility(method, *args)
        if self.stat_loggers is not None and method in ("sleep", "wake_up"):
            level = (int(args[0]) if args else 1) if method == "sleep" else 0
            self.stat_loggers.record_sleep_state(level)
        return result

    def shutdown(self) -> None:
        """Stop the engine core; idempotent."""
        self.engine_core.shutdown()
        if self.stat_loggers is not None:
            self.stat_loggers.shutdown()
