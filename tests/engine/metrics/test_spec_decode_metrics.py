"""Speculative-decoding metrics in the frontend: hand-built `SchedulerStats` carrying
`SpecDecodingStats` deltas through the Prometheus logger (counters per engine, the `position`
label, `LLM.get_metrics()`'s `Vector`, the `vllm:` names) and the logging logger (the
`SpecDecoding metrics:` line's numbers); nothing of it without speculation."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import pytest
from prometheus_client import generate_latest

from ringserve import EngineArgs
from ringserve.config import EngineConfig
from ringserve.engine.metrics.metrics_reader import Counter, Metric, Vector
from ringserve.engine.metrics.prometheus import prefixed_registry
from ringserve.engine.metrics.stat_loggers import LoggingStatLogger, StatLoggerManager
from ringserve.engine.wire import EngineCoreOutputs, SchedulerStats, SpecDecodingStats

DRAFTS = "ringserve:spec_decode_num_drafts"
DRAFT_TOKENS = "ringserve:spec_decode_num_draft_tokens"
ACCEPTED = "ringserve:spec_decode_num_accepted_tokens"
PER_POS = "ringserve:spec_decode_num_accepted_tokens_per_pos"
FAMILIES = (DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POS)

# Two snapshots of one interval that add up to 10 drafts of k = 4: 40 draft tokens, 25
# accepted, [9, 7, 5, 4] by position.
FIRST = SpecDecodingStats(num_drafts=6, num_draft_tokens=24, num_accepted_tokens=15,
                          num_accepted_tokens_per_pos=[5, 4, 3, 3])
SECOND = SpecDecodingStats(num_drafts=4, num_draft_tokens=16, num_accepted_tokens=10,
                           num_accepted_tokens_per_pos=[4, 3, 2, 1])
EXPECTED_LINE = (
    "Engine 000: SpecDecoding metrics: Mean acceptance length: 3.50, "
    "Accepted throughput: 12.50 tokens/s, Drafted throughput: 20.00 tokens/s, "
    "Accepted: 25 tokens, Drafted: 40 tokens, "
    "Per-position acceptance rate: 0.900, 0.700, 0.500, 0.400, "
    "Avg Draft acceptance rate: 62.5%")


@pytest.fixture
def config(tiny_llama_dir: Path) -> EngineConfig:
    return EngineArgs(model=str(tiny_llama_dir), device="cpu", max_model_len=256,
                      num_gpu_blocks_override=64).create_engine_config()


def _counters(metrics: list[Metric], name: str) -> dict[str, float]:
    """Engine label -> value of family `name`."""
    found = [m for m in metrics if m.name == name]
    assert all(isinstance(m, Counter) for m in found), found
    return {m.labels["engine"]: m.value for m in found if isinstance(m, Counter)}


def _vectors(metrics: list[Metric]) -> dict[str, list[float]]:
    found = [m for m in metrics if m.name == PER_POS]
    assert all(isinstance(m, Vector) for m in found), found
    return {m.labels["engine"]: m.values for m in found if isinstance(m, Vector)}


def test_stats_cross_the_wire() -> None:
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreOutputs)
    batch = EngineCoreOutputs(scheduler_stats=SchedulerStats(step_counter=2, spec_decoding=FIRST))
    stats = decoder.decode(encoder.encode(batch)).scheduler_stats
    assert stats is not None and stats.spec_decoding == FIRST


def test_counters_add_snapshots_per_engine(config: EngineConfig) -> None:
    manager = StatLoggerManager(config, [0, 1])
    try:
        manager.record(SchedulerStats(num_running_reqs=1), None, 0)
        # Not registered until a speculating core reports (vLLM: only with speculation on).
        assert not [m for m in manager.get_metrics() if m.name in FAMILIES]
        manager.record(SchedulerStats(spec_decoding=FIRST), None, 0)
        # Every engine's series exist from then on, at zero until it reports.
        assert _counters(manager.get_metrics(), DRAFTS) == {"0": 6, "1": 0}
        assert _vectors(manager.get_metrics())["1"] == [0, 0, 0, 0]
        manager.record(SchedulerStats(), None, 0)  # a snapshot without drafts
        manager.record(SchedulerStats(spec_decoding=SECOND), None, 0)
        manager.record(SchedulerStats(spec_decoding=SpecDecodingStats(
            num_drafts=1, num_draft_tokens=4, num_accepted_tokens=1,
            num_accepted_tokens_per_pos=[1, 0, 0, 0])), None, 1)
        metrics = manager.get_metrics()
        text = generate_latest().decode()
        vllm_text = generate_latest(prefixed_registry("vllm")).decode()
    finally:
        manager.shutdown()
    assert _counters(metrics, DRAFTS) == {"0": 10, "1": 1}
    assert _counters(metrics, DRAFT_TOKENS) == {"0": 40, "1": 4}
    assert _counters(metrics, ACCEPTED) == {"0": 25, "1": 1}
    assert _vectors(metrics) == {"0": [9, 7, 5, 4], "1": [1, 0, 0, 0]}
    name = config.model_config.served_model_name
    assert f'{DRAFTS}_total{{engine="0",model_name="{name}"}} 10.0' in text
    for position, value in enumerate((9, 7, 5, 4)):
        assert (f'{PER_POS}_total{{engine="0",model_name="{name}",position="{position}"}} '
                f"{value:.1f}") in text
    assert f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="{name}"}} 40.0' \
        in vllm_text
    assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="1",'
            f'model_name="{name}",position="0"}} 1.0') in vllm_text
    assert "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts." in vllm_text
    assert "ringserve:spec_decode" not in vllm_text
    assert "spec_decode" not in generate_latest().decode()  # gone with the shut-down logger


def test_positions_and_engines_added_later(config: EngineConfig) -> None:
    manager = StatLoggerManager(config, [0])
    try:
        manager.record(SchedulerStats(spec_decoding=SpecDecodingStats(
            num_drafts=2, num_draft_tokens=4, num_accepted_tokens=3,
            num_accepted_tokens_per_pos=[2, 1])), None, 0)
        manager.record(SchedulerStats(spec_decoding=SECOND), None, 0)  # k grew to 4
        manager.add_engine(config, 3)  # elastic scale-up: zero series for it
        metrics = manager.get_metrics()
    finally:
        manager.shutdown()
    assert _vectors(metrics) == {"0": [6, 4, 2, 1], "3": [0, 0, 0, 0]}
    assert _counters(metrics, ACCEPTED) == {"0": 13, "3": 0}


def test_log_line_over_an_interval(config: EngineConfig, caplog: pytest.LogCaptureFixture
                                   ) -> None:
    line_logger = LoggingStatLogger(config)
    assert line_logger.format_spec_decoding_line(line_logger._last_log_time + 2.0) is None
    line_logger.record(SchedulerStats(num_running_reqs=2, spec_decoding=FIRST), None)
    line_logger.record(SchedulerStats(num_running_reqs=2), None)
    line_logger.record(SchedulerStats(num_running_reqs=2, spec_decoding=SECOND), None)
    assert line_logger.format_spec_decoding_line(line_logger._last_log_time + 2.0) \
        == EXPECTED_LINE
    with caplog.at_level(logging.INFO, "ringserve.engine.metrics.stat_loggers"):
        line_logger.log()
        line_logger.log()  # a new interval: no drafts, no line
    said = [r.getMessage() for r in caplog.records if "SpecDecoding metrics" in r.getMessage()]
    assert len(said) == 1
    assert said[0].startswith("Engine 000: SpecDecoding metrics: Mean acceptance length: 3.50, ")
    assert said[0].endswith(", Accepted: 25 tokens, Drafted: 40 tokens, Per-position "
                            "acceptance rate: 0.900, 0.700, 0.500, 0.400, "
                            "Avg Draft acceptance rate: 62.5%")
