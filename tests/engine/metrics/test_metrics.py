"""Metrics: exact counter values after a known workload (sync LLMEngine and AsyncLLM, null
model), histogram counts, `/metrics` text parsing, several engines per process, vLLM's label
names and values under `--metrics-prefix vllm`, and the analytic FLOPs of one step of the tiny
model against a hand computation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ringserve import EngineArgs, RequestOutputKind, SamplingParams
from ringserve.config import EngineConfig
from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.engine.frontend.llm_engine import LLMEngine
from ringserve.engine.metrics.flops import ModelFlops
from ringserve.engine.metrics.metrics_reader import Counter, Gauge, Histogram, Metric
from ringserve.engine.metrics.prometheus import PrometheusStatLogger, prefixed_registry
from ringserve.engine.metrics.stat_loggers import LoggingStatLogger
from ringserve.engine.wire import SchedulerStats
from ringserve.gpu.executor.null import NullExecutor
from ringserve.gpu.wire import CachedRequestData, NewRequestData, SchedulerOutput


def _config(model_dir: Path, **kw: Any) -> EngineConfig:
    values: dict[str, Any] = {"model": str(model_dir), "device": "cpu", "max_model_len": 256,
                              "num_gpu_blocks_override": 64, **kw}
    return EngineArgs(**values).create_engine_config()


def _value(metrics: list[Metric], name: str, **labels: str) -> float:
    found = [m for m in metrics if m.name == name and isinstance(m, Counter | Gauge)
             and all(m.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0].value


def _hist(metrics: list[Metric], name: str) -> Histogram:
    found = [m for m in metrics if m.name == name and isinstance(m, Histogram)]
    assert len(found) == 1, name
    return found[0]


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> list[Any]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    finished = []
    while engine.has_unfinished_requests():
        finished.extend(o for o in engine.step() if o.finished)
    return finished


def test_sync_counters_match_workload(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(_config(tiny_llama_dir), executor_class=NullExecutor)
    try:
        long = [7] * 40
        outs = _run(engine, {
            "a": ([5] * 10, SamplingParams(max_tokens=5, ignore_eos=True)),
            "b": ([6] * 3, SamplingParams(max_tokens=7, ignore_eos=True)),
            "c": ([8] * 4, SamplingParams(max_tokens=4, n=2, ignore_eos=True)),
        })
        outs += _run(engine, {"d": (long, SamplingParams(max_tokens=2, ignore_eos=True))})
        outs += _run(engine, {"e": (long, SamplingParams(max_tokens=2, ignore_eos=True))})
        metrics = engine.get_metrics()
    finally:
        engine.shutdown()
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert completion == 5 + 7 + 2 * 4 + 2 + 2
    assert _value(metrics, "ringserve:generation_tokens") == completion
    assert _value(metrics, "ringserve:prompt_tokens") == 10 + 3 + 2 * 4 + 40 + 40
    assert _value(metrics, "ringserve:request_success", finished_reason="length") == 6
    assert _value(metrics, "ringserve:request_success", finished_reason="stop") == 0
    # The repeated 40-token prompt hits its two full 16-token blocks the second time.
    assert _value(metrics, "ringserve:prefix_cache_hits") == 32
    for name in ("ringserve:time_to_first_token_seconds", "ringserve:e2e_request_latency_seconds",
                 "ringserve:request_generation_tokens", "ringserve:request_queue_time_seconds"):
        assert _hist(metrics, name).count == 6, name
    gen = _hist(metrics, "ringserve:request_generation_tokens")
    assert gen.sum == completion and gen.buckets["+Inf"] == 6
    assert _hist(metrics, "ringserve:request_params_n").sum == 1 + 1 + 2 + 2 + 1 + 1
    # Each request contributes one inter-token latency per token after its first.
    assert _hist(metrics, "ringserve:inter_token_latency_seconds").count == completion - 6
    assert _value(metrics, "ringserve:engine_healthy", engine="0") == 1
    assert _value(metrics, "ringserve:cache_config_info", engine="0", num_gpu_blocks="64") == 1


def test_disabled_stats_have_no_metrics(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(_config(tiny_llama_dir, disable_log_stats=True),
                       executor_class=NullExecutor)
    try:
        _run(engine, {"a": ([5] * 4, SamplingParams(max_tokens=3, ignore_eos=True))})
        assert engine.get_metrics() == []
    finally:
        engine.shutdown()


def test_flops_of_one_step_match_hand_computation(tiny_llama_dir: Path) -> None:
    flops = ModelFlops.from_config(_config(tiny_llama_dir))
    # tiny llama: hidden 64, 2 layers, 4 query heads / 2 KV heads of 16, MLP 128, vocab 8000.
    h, layers, nq, nkv, d, inter, vocab = 64, 2, 4, 2, 16, 128, 8000
    params = SamplingParams(max_tokens=4)
    step = SchedulerOutput(
        step_id=1,
        scheduled_new_reqs=[NewRequestData("p", [1] * 6, params, [1], 0)],
        scheduled_cached_reqs=[CachedRequestData("q", 9)],
        num_scheduled_tokens={"p": 6, "q": 1},
        total_num_scheduled_tokens=7,
    )
    dense = layers * (2 * h * nq * d + 2 * h * 2 * nkv * d + 2 * nq * d * h + 3 * 2 * h * inter)
    # Prefill of 6 tokens attends to 1+2+...+6 positions; the decode token to 10.
    attention = layers * 4 * nq * d * ((1 + 2 + 3 + 4 + 5 + 6) + 10)
    unembed = 2 * (2 * h * vocab)
    assert flops.step_flops(step) == 7 * dense + attention + unembed


def test_mfu_flops_reach_the_counter_and_log_line(tiny_llama_dir: Path) -> None:
    config = _config(tiny_llama_dir, enable_mfu_metrics=True)
    engine = LLMEngine(config, executor_class=NullExecutor)
    try:
        _run(engine, {"a": ([5] * 6, SamplingParams(max_tokens=2, ignore_eos=True))})
        metrics = engine.get_metrics()
    finally:
        engine.shutdown()
    model = ModelFlops.from_config(config)
    expected = model.request_flops(6, 0) + model.request_flops(1, 6)
    assert _value(metrics, "ringserve:estimated_flops_per_gpu") == expected
    line_logger = LoggingStatLogger(config)
    line_logger.record(SchedulerStats(num_running_reqs=1, estimated_flops=4e12), None)
    line = line_logger.format_line(line_logger._last_log_time + 2.0)
    assert "Running: 1 reqs" in line and "Achieved: 2.00 TF/s per GPU" in line


def _async_engine(model_dir: Path, **kw: Any) -> AsyncLLM:
    values: dict[str, Any] = {"model": str(model_dir), "device": "cpu", "max_model_len": 256,
                              "num_gpu_blocks_override": 64, **kw}
    return AsyncLLM.from_engine_args(EngineArgs(**values), executor="null")


async def test_async_metrics_and_prometheus_text(tiny_llama_dir: Path) -> None:
    final = RequestOutputKind.FINAL_ONLY
    for round_ in range(2):  # a second engine in the same process must not clash
        async with _async_engine(tiny_llama_dir) as llm:
            completion = 0

            async def one(i: int, llm: AsyncLLM = llm) -> None:
                nonlocal completion
                params = SamplingParams(max_tokens=3 + i, ignore_eos=True, output_kind=final)
                async for out in llm.generate({"prompt_token_ids": [9 + i] * 5}, params):
                    completion += sum(len(c.token_ids) for c in out.outputs)

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, i)
            await llm.call_utility("sleep", 1)
            metrics = llm.get_metrics()
            text = generate_latest().decode()
            await llm.call_utility("wake_up")
        assert completion == 3 + 4 + 5 + 6, round_
        assert _value(metrics, "ringserve:generation_tokens") == completion
        assert _value(metrics, "ringserve:request_success", finished_reason="length") == 4
        assert _hist(metrics, "ringserve:time_to_first_token_seconds").count == 4
        assert _value(metrics, "ringserve:engine_sleep_state",
                      sleep_state="weights_offloaded") == 1
        assert _value(metrics, "ringserve:cache_config_info", engine="0",
                      num_gpu_blocks="64") == 1
        families = {f.name: f for f in text_string_to_metric_families(text)}
        success = [s for s in families["ringserve:request_success"].samples
                   if s.name.endswith("_total") and s.labels["finished_reason"] == "length"]
        assert [s.value for s in success] == [4.0]
        assert {"ringserve:num_requests_running", "ringserve:kv_cache_usage_perc",
                "ringserve:e2e_request_latency_seconds",
                "ringserve:iteration_tokens_total"} <= set(families)
    # Shut-down engines leave the default registry.
    assert "ringserve:" not in generate_latest().decode()


def _vllm_families() -> dict[str, Any]:
    text = generate_latest(prefixed_registry("vllm")).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_sleep_state_and_cache_config_info_are_vllms(tiny_llama_dir: Path) -> None:
    """vLLM's `vllm:engine_sleep_state{model_name, engine, sleep_state}` with its values
    (awake, weights_offloaded, discard_all) and its `vllm:cache_config_info` info gauge (the
    CacheConfig fields as labels, plus engine; value 1)."""
    config = _config(tiny_llama_dir, kv_cache_memory=16 << 20)
    prom = PrometheusStatLogger(config, [0, 1])
    try:
        prom.record_sleep_state(1, 1)
        prom.log_engine_initialized(128)
        prom.add_engine(2)  # elastic scale-up: its series too
        prom.record_sleep_state(2, 2)
        families = _vllm_families()
        prom.remove_engine(1)
        after_removal = _vllm_families()
    finally:
        prom.shutdown()
    sleep = families["vllm:engine_sleep_state"]
    assert sleep.type == "gauge"
    assert {tuple(sorted(s.labels)) for s in sleep.samples} == {
        ("engine", "model_name", "sleep_state")}
    assert {(s.labels["engine"], s.labels["sleep_state"]): s.value for s in sleep.samples} == {
        ("0", "awake"): 1, ("0", "weights_offloaded"): 0, ("0", "discard_all"): 0,
        ("1", "awake"): 0, ("1", "weights_offloaded"): 1, ("1", "discard_all"): 0,
        ("2", "awake"): 0, ("2", "weights_offloaded"): 0, ("2", "discard_all"): 1}
    info = families["vllm:cache_config_info"]
    assert info.type == "gauge"
    want = {"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.92", "kv_cache_memory_bytes": str(16 << 20),
            "num_gpu_blocks": "128", "num_gpu_blocks_override": "64",
            "prefix_caching_hash_algo": "sha256"}
    assert [(s.labels, s.value) for s in info.samples] == [
        ({**want, "engine": engine}, 1.0) for engine in ("0", "1", "2")]
    assert [s.labels["engine"] for s in after_removal["vllm:cache_config_info"].samples] == [
        "0", "2"]
