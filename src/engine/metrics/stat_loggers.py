"""Stat loggers and the `StatLoggerManager` that fans stats out to them.

A frontend (`AsyncLLM`, `LLMEngine`) builds one manager when stats are on (not
`--disable-log-stats`) and, per batch of core outputs, calls `record(scheduler_stats,
iteration_stats, engine_idx)`; every `--log-stats-interval` seconds it calls `log()`. The
manager holds, per engine (data-parallel rank), a `LoggingStatLogger` plus one logger from
each factory of the entry-point group `ringserve.stat_loggers` (a callable
`(config, engine_index) -> StatLogger`), and one `PrometheusStatLogger` for all engines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Protocol

from ringserve.config import EngineConfig
from ringserve.engine.metrics.expert_load import expert_load_shape, imbalance
from ringserve.engine.metrics.metrics_reader import Metric, get_metrics_snapshot
from ringserve.engine.metrics.prometheus import PrometheusStatLogger
from ringserve.engine.metrics.spec_decode import SpecDecodingLogging
from ringserve.engine.metrics.stats import IterationStats
from ringserve.engine.wire import SchedulerStats

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "ringserve.stat_loggers"


class StatLogger(Protocol):
    """What a per-engine stat logger implements."""

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None, engine_idx: int = 0) -> None:
        """Take one batch's stats."""

    def log(self) -> None:
        """Called every `log_stats_interval` seconds."""

    def log_engine_initialized(self) -> None:
        """Called once the engines are up."""


StatLoggerFactory = Callable[[EngineConfig, int], StatLogger]


class LoggingStatLogger:
    """One log line per interval for one engine: throughput, queue, KV usage, prefix hits
    (and, when on, TF/s and the MoE expert-load imbalance), and a second one for speculative
    decoding when the interval had drafts.

    Args:
        config: the engine configuration.
        engine_index: the engine this logger reports on.
    """

    def __init__(self, config: EngineConfig, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.enable_mfu = config.observability_config.enable_mfu_metrics
        moe = expert_load_shape(config)
        self.expert_layers = moe.sparse_layers if moe is not None else ()
        self.num_blocks: int | None = None
        self.last_scheduler_stats = SchedulerStats()
        self._last_log_time = time.monotonic()
        self._last_throughput = (0.0, 0.0)
        self.spec_decoding = SpecDecodingLogging()
        self._reset()

    def _reset(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.flops = 0.0
        self.expert_load: list[list[int]] | None = None  # summed over the interval
        self.spec_decoding.reset()

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None, engine_idx: int = 0) -> None:
        """Accumulate one batch's stats."""
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            self.last_scheduler_stats = scheduler_stats
            self.prefix_queries += scheduler_stats.prefix_cache_queries
            self.prefix_hits += scheduler_stats.prefix_cache_hits
            self.flops += scheduler_stats.estimated_flops
            if scheduler_stats.expert_load is not None:
                self._add_expert_load(scheduler_stats.expert_load)
            if scheduler_stats.spec_decoding is not None:
                self.spec_decoding.record(scheduler_stats.spec_decoding)

    def _add_expert_load(self, load: list[list[int]]) -> None:
        if self.expert_load is None:
            self.expert_load = [list(row) for row in load]
            return
        for total, row in zip(self.expert_load, load, strict=True):
            for expert, count in enumerate(row):
                total[expert] += count

    def format_line(self, now: float) -> str:
        """The log line for the interval ending at `now` (monotonic)."""
        elapsed = max(now - self._last_log_time, 1e-9)
        stats = self.last_scheduler_stats
        hit_rate = self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
        line = (f"Engine {self.engine_index:03d}: "
                f"Avg prompt throughput: {self.num_prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self.num_generation_tokens / elapsed:.1f} "
                f"tokens/s, Running: {stats.num_running_reqs} reqs, "
                f"Waiting: {stats.num_waiting_reqs} reqs, "
                f"GPU KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
                f"Prefix cache hit rate: {hit_rate * 100:.1f}%")
        if self.enable_mfu:
            line += f", Achieved: {self.flops / elapsed / 1e12:.2f} TF/s per GPU"
        worst = imbalance(self.expert_load) if self.expert_load is not None else None
        if worst is not None and self.expert_layers:
            ratio, position = worst
            line += (f", MoE expert load max/mean: {ratio:.2f} "
                     f"(layer {self.expert_layers[position]})")
        return line

    def format_spec_decoding_line(self, now: float) -> str | None:
        """The speculative-decoding line for the interval ending at `now` (monotonic), or None
        when it had no drafts."""
        line = self.spec_decoding.format_line(now - self._last_log_time)
        return f"Engine {self.engine_index:03d}: {line}" if line is not None else None

    def log(self) -> None:
        """Log the interval's line (skipped while idle twice running), its speculative-decoding
        line when it had drafts, and start a new interval."""
        now = time.monotonic()
        elapsed = max(now - self._last_log_time, 1e-9)
        throughput = (self.num_prompt_tokens / elapsed, self.num_generation_tokens / elapsed)
        busy = any(throughput) or any(self._last_throughput) or (
            self.last_scheduler_stats.num_running_reqs + self.last_scheduler_stats.num_waiting_reqs)
        if busy:
            logger.info("%s", self.format_line(now))
        spec_line = self.format_spec_decoding_line(now)
        if spec_line is not None:
            logger.info("%s", spec_line)
        self._last_throughput = throughput
        self._last_log_time = now
        self._reset()

    def log_engine_initialized(self) -> None:
        """Say the engine is up."""
        logger.info("Engine %03d: stats logging every interval is on", self.engine_index)


def load_entry_point_factories() -> list[StatLoggerFactory]:
    """Factories registered under the `ringserve.stat_loggers` entry-point group."""
    factories: list[StatLoggerFactory] = []
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        factory: StatLoggerFactory = entry.load()
        factories.append(factory)
    return factories


class StatLoggerManager:
    """Fans stats out to per-engine loggers and one Prometheus logger.

    Args:
        config: the engine configuration.
        engine_indexes: the data-parallel ranks of this frontend's engines.
        custom_factories: extra per-engine logger factories (in addition to entry points).
        enable_default_loggers: include the LoggingStatLogger.
    """

    def __init__(self, config: EngineConfig, engine_indexes: list[int] | None = None, *,
                 custom_factories: list[StatLoggerFactory] | None = None,
                 enable_default_loggers: bool = True) -> None:
        indexes = engine_indexes if engine_indexes is not None else [0]
        self._factories = [*load_entry_point_factories(), *(custom_factories or [])]
        self._default_loggers = enable_default_loggers
        self.per_engine: dict[int, list[StatLogger]] = {}
        for index in indexes:
            self.per_engine[index] = self._loggers_of(config, index)
        self.prometheus = PrometheusStatLogger(config, indexes)

    def _loggers_of(self, config: EngineConfig, index: int) -> list[StatLogger]:
        loggers: list[StatLogger] = []
        if self._default_loggers:
            loggers.append(LoggingStatLogger(config, index))
        loggers.extend(factory(config, index) for factory in self._factories)
        return loggers

    def add_engine(self, config: EngineConfig, index: int) -> None:
        """An engine joined (elastic scale-up): its loggers, and its Prometheus series."""
        self.per_engine[index] = loggers = self._loggers_of(config, index)
        for stat_logger in loggers:
            stat_logger.log_engine_initialized()
        self.prometheus.add_engine(index)

    def remove_engine(self, index: int) -> None:
        """An engine left (elastic scale-down): its loggers go, and its gauges (its counters
        and histograms stay: what it served was served)."""
        self.per_engine.pop(index, None)
        self.prometheus.remove_engine(index)

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None, engine_idx: int = 0) -> None:
        """Hand one batch's stats to the engine's loggers and to Prometheus."""
        for stat_logger in self.per_engine.get(engine_idx, ()):
            stat_logger.record(scheduler_stats, iteration_stats, engine_idx)
        self.prometheus.record(scheduler_stats, iteration_stats, engine_idx)

    def record_mm_cache(self, queries: int, hits: int) -> None:
        """The frontend's processed-image cache lookups since the last call."""
        self.prometheus.record_mm_cache(queries, hits)

    def record_sleep_state(self, level: int) -> None:
        """Every engine is now at sleep `level` (0: awake)."""
        for index in self.per_engine:
            self.prometheus.record_sleep_state(level, index)

    def record_health(self, healthy: bool) -> None:
        """Every engine is now healthy (or dead)."""
        for index in self.per_engine:
            self.prometheus.record_health(healthy, index)

    def log(self) -> None:
        """Let every logger emit its interval output."""
        for loggers in self.per_engine.values():
            for stat_logger in loggers:
                stat_logger.log()

    def log_engine_initialized(self, num_gpu_blocks: int | None = None) -> None:
        """Tell every logger the engines are up, and publish the cache configuration.

        Args:
            num_gpu_blocks: KV blocks of all the frontend's engines together (None: unknown).
        """
        for loggers in self.per_engine.values():
            for stat_logger in loggers:
                stat_logger.log_engine_initialized()
        self.prometheus.log_engine_initialized(num_gpu_blocks)

    def get_metrics(self) -> list[Metric]:
        """A snapshot of this frontend's Prometheus series."""
        return get_metrics_snapshot(self.prometheus.registry)

    def shutdown(self) -> None:
        """Stop publishing to the default registry."""
        self.prometheus.shutdown()
