"""Expert-load metrics (--enable-expert-load-metrics): every scheduled token of a tiny Qwen3-MoE
counted top-k times on each sparse layer, from `LLM` down to the experts (and across a weight
reload); the stats' wire form; the Prometheus family and its text exposition; the log line's
imbalance; when the core pulls; and nothing of it by default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ringserve import EngineArgs, SamplingParams
from ringserve.config import EngineConfig
from ringserve.engine.frontend.input_processor import TokensPrompt
from ringserve.engine.frontend.llm import LLM
from ringserve.engine.metrics.expert_load import ExpertLoadPuller, imbalance
from ringserve.engine.metrics.metrics_reader import Counter, Metric
from ringserve.engine.metrics.stat_loggers import LoggingStatLogger, StatLoggerManager
from ringserve.engine.wire import EngineCoreOutputs, SchedulerStats
from ringserve.gpu.testing import tiny_model
from ringserve.moe_shape import MoeShape

FAMILY = "ringserve:moe_expert_load_tokens"
TOP_K, EXPERTS = 2, 8  # the tiny Qwen3-MoE: layers 0 and 2 sparse, layer 1 dense


def _config(preset: str = "qwen3moe", **kw: Any) -> EngineConfig:
    values: dict[str, Any] = {"model": str(tiny_model(preset)), "device": "cpu",
                              "max_model_len": 256, "num_gpu_blocks_override": 64, **kw}
    return EngineArgs(**values).create_engine_config()


def _per_layer(metrics: list[Metric]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for m in metrics:
        if m.name == FAMILY:
            assert isinstance(m, Counter)
            totals[m.labels["layer"]] = totals.get(m.labels["layer"], 0.0) + m.value
    return totals


@pytest.mark.slow
def test_llm_counts_each_scheduled_token_top_k_times_per_sparse_layer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The core in this process (half the start-up time); the wire form is tested below.
    monkeypatch.setenv("RINGSERVE_ENABLE_MULTIPROCESSING", "0")
    prompts = [TokensPrompt(prompt_token_ids=[5 + i] * (3 + 2 * i)) for i in range(3)]
    params = [SamplingParams(max_tokens=4 + i, ignore_eos=True) for i in range(3)]
    # Prefix caching off: every prompt token is computed (and routed) each time.
    with LLM(str(tiny_model("qwen3moe")), device="cpu", max_model_len=256,
             num_gpu_blocks_override=64, enable_prefix_caching=False,
             enable_expert_load_metrics=True) as llm:
        outs = llm.generate(prompts, params)
        # A request's forwards see its prompt and every generated token but the last.
        tokens = sum(len(p["prompt_token_ids"]) + len(o.outputs[0].token_ids) - 1
                     for p, o in zip(prompts, outs, strict=True))
        assert tokens == (3 + 5 + 7) + (4 + 5 + 6) - 3
        metrics = llm.get_metrics()
        assert _per_layer(metrics) == {"0": TOP_K * tokens, "2": TOP_K * tokens}
        series = [m for m in metrics if m.name == FAMILY]
        assert {(m.labels["layer"], m.labels["expert"]) for m in series} == {
            (layer, str(e)) for layer in ("0", "2") for e in range(EXPERTS)}
        assert {m.labels["engine"] for m in series} == {"0"}
        text = generate_latest().decode()
        # Sleep level 2 drops the weights; the reloaded model counts on into the same totals.
        llm.sleep(2)
        llm.wake_up()
        llm.generate(prompts, params)
        assert _per_layer(llm.get_metrics()) == {"0": 2 * TOP_K * tokens,
                                                 "2": 2 * TOP_K * tokens}
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = [s for s in families[FAMILY].samples if s.name == FAMILY + "_total"]
    assert len(samples) == 2 * EXPERTS
    assert sum(s.value for s in samples if s.labels["layer"] == "2") == TOP_K * tokens


def test_expert_load_crosses_the_wire() -> None:
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreOutputs)
    load = [[1, 0, 2**40], [3, 4, 5]]
    batch = EngineCoreOutputs(scheduler_stats=SchedulerStats(step_counter=3, expert_load=load))
    decoded = decoder.decode(encoder.encode(batch)).scheduler_stats
    assert decoded is not None and decoded.expert_load == load
    # Between pulls the field is None: one nil byte on the wire.
    without = EngineCoreOutputs(scheduler_stats=SchedulerStats(step_counter=3))
    stats = decoder.decode(encoder.encode(without)).scheduler_stats
    assert stats is not None and stats.expert_load is None and stats.step_counter == 3


def test_off_by_default_and_without_stats_or_experts(tiny_llama_dir: Path) -> None:
    for config in (_config(), _config(enable_expert_load_metrics=True, disable_log_stats=True),
                   _config("llama", enable_expert_load_metrics=True)):
        assert ExpertLoadPuller.for_config(config, 0.0) is None
        manager = StatLoggerManager(config)
        try:
            manager.record(SchedulerStats(num_running_reqs=1), None)
            assert not [m for m in manager.get_metrics() if m.name == FAMILY]
        finally:
            manager.shutdown()
    assert FAMILY not in generate_latest().decode()


def test_prometheus_family_and_log_line_add_up_the_deltas() -> None:
    config = _config("qwen2moe", enable_expert_load_metrics=True)  # layer 1 sparse only
    manager = StatLoggerManager(config, [0, 1])
    try:
        zero = [m for m in manager.get_metrics() if m.name == FAMILY]
        assert len(zero) == 2 * EXPERTS
        assert all(isinstance(m, Counter) and m.value == 0 for m in zero)
        manager.record(SchedulerStats(expert_load=[[4, 0, 0, 0, 0, 0, 0, 4]]), None, 0)
        manager.record(SchedulerStats(), None, 0)  # no pull in this batch
        manager.record(SchedulerStats(expert_load=[[1, 0, 0, 0, 0, 0, 0, 3]]), None, 0)
        manager.record(SchedulerStats(expert_load=[[2] * EXPERTS]), None, 1)
        metrics = manager.get_metrics()
        text = generate_latest().decode()
        line = manager.per_engine[0][0]
        assert isinstance(line, LoggingStatLogger)
        formatted = line.format_line(line._last_log_time + 1.0)
    finally:
        manager.shutdown()
    values = {(m.labels["engine"], m.labels["expert"]): m.value for m in metrics
              if m.name == FAMILY and isinstance(m, Counter)}
    assert values[("0", "0")] == 5 and values[("0", "7")] == 7 and values[("0", "3")] == 0
    assert values[("1", "5")] == 2
    assert {m.labels["layer"] for m in metrics if m.name == FAMILY} == {"1"}
    name = config.model_config.served_model_name
    assert (f'{FAMILY}_total{{engine="0",expert="7",layer="1",model_name="{name}"}} 7.0'
            in text)
    # 12 tokens over 8 experts, 7 on one: max / mean = 7 / 1.5.
    assert formatted.endswith("MoE expert load max/mean: 4.67 (layer 1)")


def test_imbalance_picks_the_worst_layer() -> None:
    assert imbalance([[1, 1], [3, 1], [0, 0]]) == (1.5, 1)
    assert imbalance([[0, 0]]) is None


def _shape() -> MoeShape:
    return MoeShape(num_experts=2, top_k=1, moe_intermediate_size=4,
                    shared_expert_intermediate_size=0, renormalize=True, sparse_layers=(0, 3))


def test_puller_pulls_per_interval_or_when_idle_and_sends_deltas() -> None:
    puller = ExpertLoadPuller(_shape(), interval=10.0, now=100.0)
    workers, new_workers = object(), object()
    assert not puller.due(workers, step_counter=1, idle=False, now=105.0)
    assert puller.due(workers, step_counter=1, idle=False, now=110.0)
    assert puller.take(workers, [[3, 1], [0, 4]], 1, 110.0) == [[3, 1], [0, 4]]
    assert not puller.due(workers, step_counter=2, idle=False, now=115.0)
    # Out of requests: pull now, but not twice for the same step.
    assert puller.due(workers, step_counter=2, idle=True, now=115.0)
    assert puller.take(workers, [[5, 1], [0, 6]], 2, 115.0) == [[2, 0], [0, 2]]
    assert not puller.due(workers, step_counter=2, idle=True, now=200.0)
    # New workers (after a fault) count from zero, under a new scheduler's step counter.
    assert puller.due(new_workers, step_counter=2, idle=True, now=116.0)
    assert puller.take(new_workers, [[1, 0], [0, 0]], 2, 116.0) == [[1, 0], [0, 0]]
    assert puller.take(workers, [], 3, 130.0) is None  # workers that count nothing
    with pytest.raises(ValueError, match="1 layers"):
        puller.take(workers, [[1, 2]], 4, 140.0)
