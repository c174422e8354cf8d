"""`PrometheusStatLogger`: scheduler and iteration stats as `ringserve:` Prometheus families.

Names, types and buckets mirror vLLM's V1 metrics (`vllm:` -> `ringserve:`), labelled with
`model_name` and `engine` (the data-parallel rank); label names and values are vLLM's too
(`sleep_state`, `finished_reason`, `cache_config_info`'s fields). `prefixed_registry("vllm")` is what
`/metrics` serves under `--metrics-prefix vllm`: the same families named `vllm:...`, so
dashboards and autoscalers written for vLLM read them unchanged. The `StatLoggerManager` owns one for all
engines of a frontend; the HTTP server's `/metrics` serves the default registry.

Prometheus families are process-global, yet tests (and a process that restarts its engine)
build several engines in one process. So each logger keeps its families in its own
`CollectorRegistry`, and one `_LiveRegistries` collector, registered in the default registry
once per process, yields the families of every live logger (merged by name). `shutdown()`
drops a logger from it; a new logger never collides with an old one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ringserve.config import EngineConfig
from ringserve.engine.metrics.expert_load import expert_load_shape
from ringserve.engine.metrics.spec_decode import SpecDecodingProm
from ringserve.engine.metrics.stats import IterationStats
from ringserve.engine.wire import FinishReason, SchedulerStats

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
N_BUCKETS = [1.0, 2.0, 5.0, 10.0, 20.0]
# `sleep_state` values by sleep level 0, 1, 2: vLLM's names (its level 1 offloads the weights;
# ringserve's frees the KV cache and keeps them, but dashboards key on these values).
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
PREFIX = "ringserve"


def cache_config_labels(config: EngineConfig, num_gpu_blocks: int | None) -> dict[str, str]:
    """`cache_config_info`'s labels but `engine`: the vLLM `CacheConfig` fields ringserve has a
    value for, named as vLLM names them and written as vLLM writes them (Python's `str`:
    `True`, `None`, `0.92`). The KV cache is kept in the model's dtype (vLLM's `auto`) and
    block hashes are SHA-256 (vLLM's default, `sha256`).

    Args:
        config: the engine configuration.
        num_gpu_blocks: KV blocks of all the frontend's engines together (vLLM sums its
            data-parallel engines' counts), None before they are known.
    """
    cache = config.cache_config
    return {"block_size": str(cache.block_size), "cache_dtype": "auto",
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "kv_cache_memory_bytes": str(cache.kv_cache_memory),
            "num_gpu_blocks": str(num_gpu_blocks),
            "num_gpu_blocks_override": str(cache.num_gpu_blocks_override),
            "prefix_caching_hash_algo": "sha256"}


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1


def build_iteration_buckets(max_num_batched_tokens: int) -> list[float]:
    """1, 8, 16, 32, ... doubling up to `max_num_batched_tokens` (tokens per step)."""
    buckets = [1.0, 8.0]
    value = 16
    while value < max_num_batched_tokens:
        buckets.append(float(value))
        value *= 2
    buckets.append(float(max(max_num_batched_tokens, 9)))
    return buckets


class _LiveRegistries(Collector):
    """Yields the families of every live logger's registry, merged by family name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registries: list[CollectorRegistry] = []
        self._registered = False

    def add(self, registry: CollectorRegistry) -> None:
        with self._lock:
            self._registries.append(registry)
            if not self._registered:
                REGISTRY.register(self)
                self._registered = True

    def remove(self, registry: CollectorRegistry) -> None:
        with self._lock:
            if registry in self._registries:
                self._registries.remove(registry)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            registries = list(self._registries)
        merged: dict[str, Metric] = {}
        for registry in registries:
            for family in registry.collect():
                known = merged.get(family.name)
                if known is None:
                    merged[family.name] = family
                else:
                    known.samples.extend(family.samples)
        return list(merged.values())

    def describe(self) -> Iterable[Metric]:
        return []  # families come and go with engines; never checked for clashes


_LIVE = _LiveRegistries()


class _Renamed(Collector):
    """The families of a registry with `ringserve:` names under another prefix."""

    def __init__(self, source: CollectorRegistry, prefix: str) -> None:
        self.source = source
        self.old = f"{PREFIX}:"
        self.new = f"{prefix}:"

    def collect(self) -> Iterable[Metric]:
        for family in self.source.collect():
            if not family.name.startswith(self.old):
                yield family  # process_*, python_gc_*: the same names as vLLM's
                continue
            renamed = Metric(self._rename(family.name), family.documentation, family.type,
                             family.unit)
            renamed.samples = [s._replace(name=self._rename(s.name)) for s in family.samples]
            yield renamed

    def describe(self) -> Iterable[Metric]:
        return []

    def _rename(self, name: str) -> str:
        return self.new + name[len(self.old):] if name.startswith(self.old) else name


def prefixed_registry(prefix: str = PREFIX) -> CollectorRegistry:
    """The registry `/metrics` serves: the default one, or a view of it with every
    `ringserve:` family named `{prefix}:` instead (`--metrics-prefix vllm`).

    In a frontend of a scaled-out deployment (`PROMETHEUS_MULTIPROC_DIR` set by its
    supervisor before this process started), the source is every frontend's families, read
    from that directory: counters and histograms summed over frontends, gauges as most
    recently set (`ringserve.http.scaleout`).
    """
    source = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        source = CollectorRegistry(auto_describe=False)
        multiprocess.MultiProcessCollector(source)  # type: ignore[no-untyped-call]
    if prefix == PREFIX:
        return source
    view = CollectorRegistry(auto_describe=False)
    view.register(_Renamed(source, prefix))
    return view


class PrometheusStatLogger:
    """Publishes stats of one frontend's engines as Prometheus families.

    Args:
        config: the engine configuration (model name, token limits for buckets).
        engine_indexes: the data-parallel ranks (one `engine` label value each).
    """

    def __init__(self, config: EngineConfig, engine_indexes: list[int]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.engine_indexes = list(engine_indexes)
        self._model_name = config.model_config.served_model_name
        max_len = config.model_config.max_model_len
        batched = config.scheduler_config.max_num_batched_tokens
        self._families: dict[str, Any] = {}
        self._config = config
        # cache_config_info's labels but `engine`, once `log_engine_initialized` has them.
        self._cache_info: dict[str, str] | None = None
        gauge, counter, hist = self._gauge, self._counter, self._histogram
        gauge("num_requests_running", "Requests in model execution batches.")
        gauge("num_requests_waiting", "Requests waiting to be processed.")
        gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        gauge("engine_healthy", "1 while the engine core is alive, 0 once it is dead.")
        gauge("engine_sleep_state", "1 for the engine's current sleep state, 0 for the others: "
              "awake; weights_offloaded (sleep level 1: KV cache freed); discard_all (level 2: "
              "weights freed too).", ("sleep_state",))
        # An info gauge (always 1) as vLLM has it: no model_name, the config in the labels.
        self._families["cache_config_info"] = Gauge(
            f"{PREFIX}:cache_config_info", "The KV cache configuration (vLLM's CacheConfig "
            "fields), one series per engine, value 1.",
            [*cache_config_labels(config, None), "engine"], registry=self.registry,
            multiprocess_mode="mostrecent")
        # vLLM's LoRA info gauge: no model_name or engine label; the value is the time of the
        # last update, the adapters in the labels (names joined by commas).
        self._lora_max = (str(config.lora_config.max_loras)
                          if config.lora_config is not None else None)
        if self._lora_max is not None:
            self._families["lora_requests_info"] = Gauge(
                f"{PREFIX}:lora_requests_info", "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry, multiprocess_mode="mostrecent")
        if config.multimodal_config is not None:
            # Images (`ringserve.gpu.multimodal`): vLLM's processed-image cache families
            # (per-image lookups in the frontend's cache), and the workers' encoder cache.
            counter("mm_cache_queries", "Multi-modal cache queries, in terms of number of "
                    "items.")
            counter("mm_cache_hits", "Multi-modal cache hits, in terms of number of items.")
            gauge("encoder_cache_usage_perc", "Encoder cache usage. 1 means 100 percent "
                  "usage.")
        counter("prefix_cache_queries", "Prefix cache queries, in terms of number of tokens.")
        counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        counter("prompt_tokens", "Number of prefill tokens processed.")
        counter("generation_tokens", "Number of generation tokens processed.")
        counter("request_success", "Count of successfully processed requests.",
                ("finished_reason",))
        counter("estimated_flops_per_gpu", "Estimated FLOPs per GPU (analytic; "
                "--enable-mfu-metrics).")
        hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
             TTFT_BUCKETS)
        hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
             ITL_BUCKETS)
        hist("request_time_per_output_token_seconds",
             "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        for name, what in (("e2e_request_latency", "e2e request latency"),
                           ("request_queue_time", "time spent in WAITING phase for request"),
                           ("request_inference_time", "time spent in RUNNING phase for request"),
                           ("request_prefill_time", "time spent in PREFILL phase for request"),
                           ("request_decode_time", "time spent in DECODE phase for request")):
            hist(f"{name}_seconds", f"Histogram of {what} in seconds.", LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max_len)
        hist("request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        hist("request_generation_tokens", "Number of generation tokens processed.",
             token_buckets)
        hist("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
             token_buckets)
        hist("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        hist("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
             build_iteration_buckets(batched))
        # Opt-in (--enable-expert-load-metrics, MoE models): one series per layer and expert.
        moe = expert_load_shape(config)
        self._expert_layers = [str(layer) for layer in moe.sparse_layers] if moe else []
        self._num_experts = moe.num_experts if moe else 0
        self._expert_children: dict[int, list[list[Any]]] = {}
        if moe is not None:
            counter("moe_expert_load_tokens", "Tokens routed to each expert of each "
                    "mixture-of-experts layer (--enable-expert-load-metrics); layer: the "
                    "decoder layer index.", ("layer", "expert"))
        # Registered once a speculating core reports drafts (ringserve.engine.metrics.spec_decode).
        self.spec_decoding = SpecDecodingProm(self.registry, PREFIX, self._model_name,
                                              self.engine_indexes)
        for engine in self.engine_indexes:
            self._start_series(engine)
        _LIVE.add(self.registry)

    def _start_series(self, engine: int) -> None:
        self.record_health(True, engine)
        self.record_sleep_state(0, engine)
        if self._cache_info is not None:
            self._families["cache_config_info"].labels(**self._cache_info,
                                                       engine=str(engine)).set(1)
        for reason in FinishReason:
            self._child("request_success", engine, str(reason))
        if self._num_experts:
            self._expert_series(engine)

    def add_engine(self, engine: int) -> None:
        """Publish series for an engine that joined (elastic scale-up)."""
        if engine not in self.engine_indexes:
            self.engine_indexes.append(engine)
            self._start_series(engine)
            self.spec_decoding.add_engine(engine)

    def remove_engine(self, engine: int) -> None:
        """Drop the gauges of an engine that left (elastic scale-down); its counters and
        histograms stay."""
        if engine not in self.engine_indexes:
            return
        self.engine_indexes.remove(engine)
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            return  # series live in files there; prometheus_client cannot remove them
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                     "engine_healthy"):
            self._families[name].remove(self._model_name, str(engine))
        for state in SLEEP_STATES:
            self._families["engine_sleep_state"].remove(self._model_name, str(engine), state)
        if self._cache_info is not None:
            self._families["cache_config_info"].remove(*self._cache_info.values(), str(engine))

    def record_mm_cache(self, queries: int, hits: int) -> None:
        """Count the frontend's processed-image cache lookups since the last call."""
        if "mm_cache_queries" in self._families and (queries or hits):
            engine = self.engine_indexes[0] if self.engine_indexes else 0
            self._child("mm_cache_queries", engine).inc(queries)
            self._child("mm_cache_hits", engine).inc(hits)

    # -- family construction -------------------------------------------------------------------

    def _labels(self, extra: tuple[str, ...]) -> list[str]:
        return ["model_name", "engine", *extra]

    def _gauge(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> None:
        self._families[name] = Gauge(f"{PREFIX}:{name}", doc, self._labels(extra),
                                     registry=self.registry, multiprocess_mode="mostrecent")

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> None:
        self._families[name] = Counter(f"{PREFIX}:{name}", doc, self._labels(extra),
                                       registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: list[float]) -> None:
        self._families[name] = Histogram(f"{PREFIX}:{name}", doc, self._labels(()),
                                         buckets=buckets, registry=self.registry)

    def _child(self, name: str, engine: int, *extra: str) -> Any:
        return self._families[name].labels(self._model_name, str(engine), *extra)

    def _expert_series(self, engine: int) -> list[list[Any]]:
        """The engine's expert-load series, per sparse layer and expert (made once)."""
        series = self._expert_children.get(engine)
        if series is None:
            series = self._expert_children[engine] = [
                [self._child("moe_expert_load_tokens", engine, layer, str(expert))
                 for expert in range(self._num_experts)] for layer in self._expert_layers]
        return series

    # -- recording -----------------------------------------------------------------------------

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None, engine_idx: int = 0) -> None:
        """Publish one batch's stats of engine `engine_idx`."""
        child = self._child
        if scheduler_stats is not None:
            child("num_requests_running", engine_idx).set(scheduler_stats.num_running_reqs)
            child("num_requests_waiting", engine_idx).set(scheduler_stats.num_waiting_reqs)
            child("kv_cache_usage_perc", engine_idx).set(scheduler_stats.kv_cache_usage)
            child("prefix_cache_queries", engine_idx).inc(scheduler_stats.prefix_cache_queries)
            child("prefix_cache_hits", engine_idx).inc(scheduler_stats.prefix_cache_hits)
            child("num_preemptions", engine_idx).inc(scheduler_stats.num_preemptions)
            child("estimated_flops_per_gpu", engine_idx).inc(scheduler_stats.estimated_flops)
            load = scheduler_stats.expert_load
            if load is not None and self._expert_layers:
                rows = self._expert_series(engine_idx)
                for row, counts in zip(rows, load, strict=True):
                    for series, count in zip(row, counts, strict=True):
                        if count:
                            series.inc(count)
            if scheduler_stats.spec_decoding is not None:
                self.spec_decoding.record(scheduler_stats.spec_decoding, engine_idx)
            if scheduler_stats.encoder_cache_usage is not None and \
                    "encoder_cache_usage_perc" in self._families:
                child("encoder_cache_usage_perc", engine_idx).set(
                    scheduler_stats.encoder_cache_usage)
            if self._lora_max is not None and scheduler_stats.lora_running is not None:
                self._families["lora_requests_info"].labels(
                    self._lora_max, ",".join(sorted(scheduler_stats.lora_waiting or {})),
                    ",".join(sorted(scheduler_stats.lora_running))).set_to_current_time()
        if iteration_stats is None:
            return
        stats = iteration_stats
        child("prompt_tokens", engine_idx).inc(stats.num_prompt_tokens)
        child("generation_tokens", engine_idx).inc(stats.num_generation_tokens)
        total = stats.num_prompt_tokens + stats.num_generation_tokens
        if total:
            child("iteration_tokens_total", engine_idx).observe(total)
        _observe_all(child("time_to_first_token_seconds", engine_idx),
                     stats.time_to_first_tokens_iter)
        _observe_all(child("inter_token_latency_seconds", engine_idx),
                     stats.inter_token_latencies_iter)
        for done in stats.finished_requests:
            # A request under an adapter counts under the adapter's name (issue 42, item 5).
            self._families["request_success"].labels(
                done.lora_name or self._model_name, str(engine_idx),
                str(done.finish_reason)).inc()
            child("e2e_request_latency_seconds", engine_idx).observe(done.e2e_latency)
            child("request_queue_time_seconds", engine_idx).observe(done.queued_time)
            child("request_inference_time_seconds", engine_idx).observe(done.inference_time)
            child("request_prefill_time_seconds", engine_idx).observe(done.prefill_time)
            child("request_decode_time_seconds", engine_idx).observe(done.decode_time)
            child("request_time_per_output_token_seconds", engine_idx).observe(
                done.mean_time_per_output_token)
            child("request_prompt_tokens", engine_idx).observe(done.num_prompt_tokens)
            child("request_generation_tokens", engine_idx).observe(done.num_generation_tokens)
            child("request_params_n", engine_idx).observe(done.n_param)
            if done.max_tokens_param is not None:
                child("request_params_max_tokens", engine_idx).observe(done.max_tokens_param)

    def record_sleep_state(self, level: int, engine_idx: int = 0) -> None:
        """Set the sleep-state gauge of an engine (level 0 awake, 1 KV cache freed, 2 the
        weights too; labelled with vLLM's names, `SLEEP_STATES`)."""
        for index, state in enumerate(SLEEP_STATES):
            self._child("engine_sleep_state", engine_idx, state).set(1 if index == level else 0)

    def record_health(self, healthy: bool, engine_idx: int = 0) -> None:
        """Set the health gauge of an engine."""
        self._child("engine_healthy", engine_idx).set(1 if healthy else 0)

    def log(self) -> None:
        """Nothing to do: Prometheus pulls."""

    def log_engine_initialized(self, num_gpu_blocks: int | None = None) -> None:
        """Publish `cache_config_info` for every engine (vLLM does it here too, once the KV
        cache is sized).

        Args:
            num_gpu_blocks: KV blocks of all the frontend's engines together.
        """
        family = self._families["cache_config_info"]
        if self._cache_info is not None and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            family.clear()
        self._cache_info = cache_config_labels(self._config, num_gpu_blocks)
        for engine in self.engine_indexes:
            family.labels(**self._cache_info, engine=str(engine)).set(1)

    def shutdown(self) -> None:
        """Stop publishing this logger's families in the default registry."""
        _LIVE.remove(self.registry)


def _observe_all(histogram: Any, values: Iterator[float] | list[float]) -> None:
    for value in values:
        histogram.observe(value)
