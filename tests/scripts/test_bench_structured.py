"""The structured-outputs benchmark's core function on a tiny config (null model, a few
steps): the shape of what it returns, its token checks and its tables; no timing asserts."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_structured.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_structured", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_bench_structured_null_model_smoke() -> None:
    bench = _load()
    results = bench.bench(["null"], [4], runs=1, max_tokens=4, max_tokens_json=48,
                          log=lambda _: None)
    (entry,) = results["executors"]["null"]
    assert entry["concurrency"] == 4
    (rnd,) = entry["rounds"]
    for mode in ("free", "json"):
        run = rnd[mode]
        assert run["wall_s"] > 0
        assert len(run["tokens"]) == len(run["finish"]) == 4
        assert all(count > 0 for count in run["tokens"])
        probe = run["probe"]
        assert {"mask_us_per_step", "mask_us_per_row", "wait_ms_per_step",
                "hidden_fraction", "steps"} <= set(probe)
        assert probe["steps"] > 0
    assert rnd["json"]["kinds"] == ["json", "free", "json", "free"]
    assert rnd["free"]["kinds"] == ["twin", "free", "twin", "free"]
    assert rnd["json"]["probe"]["mask_steps"] > 0 and rnd["free"]["probe"]["mask_steps"] == 0
    checks = entry["checks"]
    assert checks["free_count_mismatches"] == 0  # free requests made exactly max_tokens
    assert checks["json"]["outputs"] == 2
    assert sum(checks["json_finish"].values()) == 2
    text = bench.tables(results)
    assert "constrained / free per round" in text and "bitmask µs / row" in text
    assert "| 4 |" in text
    # The targets are judged on the demo model only.
    assert bench.verdicts(results) == ["targets: need the default executor (the demo model)"]
