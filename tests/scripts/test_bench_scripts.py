"""The benchmark scripts' reporting: the serving comparison's medians, ranges, per-round ratios
and token check (from saved results), and (slow) the scheduler bench's vLLM line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(tok_s: float, p99_ttft: float, lens: list[int], mismatches: int = 0) -> dict[str, Any]:
    r: dict[str, Any] = {m: 1.0 for m in ("request_throughput", "median_ttft_ms", "median_itl_ms",
                                          "p99_itl_ms", "median_tpot_ms", "median_e2el_ms")}
    r.update(output_throughput=tok_s, p99_ttft_ms=p99_ttft, output_lens=lens,
             total_output_tokens=sum(lens), requested_output_tokens=8, total_output_chunks=8,
             token_count_mismatches=mismatches, random_output_len=4)
    return r


def test_serve_compare_medians_ranges_and_token_check() -> None:
    compare = _load("bench_serve_compare")
    rounds = [
        {"ringserve": _result(r, 300, [4, 4]), "transformers serve (defaults)": _result(t, 900, [4, 4])}
        for r, t in ((2000, 1000), (1500, 500), (1800, 600))
    ]
    rounds[1]["transformers serve (defaults)"] = _result(500, 900, [4, 3], mismatches=1)
    summary = compare.summarize(rounds)
    assert summary["ringserve"]["output_throughput"] == (1800, 1500, 2000)
    assert summary["transformers serve (defaults)"]["output_throughput"] == (600, 500, 1000)
    table = compare.table(summary, 3)
    assert "median of 3, range" in table and "1,800 (1,500-2,000)" in table
    # Ratios are per round (2.0, 3.0, 3.0), not a ratio of medians (3.0).
    targets = compare.targets(rounds)
    assert "per round: 2.00, 3.00, 3.00" in targets and "range 2.00-3.00" in targets
    assert "P99 TTFT lower in 3 of 3 rounds" in targets
    checks = compare.token_check(rounds)
    assert len(checks) == 6
    assert sum("TOKEN COUNT MISMATCH in 1 requests" in line for line in checks) == 1


@pytest.mark.slow
def test_scheduler_bench_says_where_the_vllm_figures_come_from() -> None:
    run = subprocess.run([sys.executable, str(SCRIPTS / "bench_scheduler.py"), "--quick", "--vllm"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert "vLLM scheduler: skipped (vllm does not import here)" in run.stdout
        assert "quoted from issue 4, another run" in run.stdout
    else:
        assert "this run" in run.stdout
    assert "command:" in run.stdout and "machine:" in run.stdout


@pytest.mark.slow
def test_profile_decode_breakdown_adds_up_and_unwraps(demo_model_dir: Path) -> None:
    import argparse

    import torch

    profile = _load("profile_decode")
    max_len = 64
    kw = profile.engine_kwargs("demo", demo_model_dir, 2, max_len)
    kw["model"] = str(demo_model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second OpenMP thread only adds stalls on a busy box
    try:
        runner = profile.build_runner(kw, 1 + 2 * (max_len // profile.BLOCK_SIZE))
        args = argparse.Namespace(prompt_len=8, steps=2, warmup=1, runs=1)
        result = profile.profile_batch(runner, 2, args, max_len, log=lambda _s: None)
    finally:
        torch.set_num_threads(threads)
    b = result["breakdown"]
    parts = sum(b[c] for c in profile.CATEGORIES)
    assert b["step"] > 0 and abs(parts + b["other"] - b["step"]) < 1e-9
    assert all(b[c] > 0 for c in ("qkv_proj", "attention", "LM head", "sampler", "input prep"))
    # The wrappers are gone: the runner's, model's and backend's methods are the class's again.
    assert "execute_model" not in vars(runner) and "attend" not in vars(runner.backend)
    assert not runner.table.requests  # the batch was finished
    table = profile.report("demo", [result], None, bandwidth=1e10)
    assert "| 2 |" in table and "| other |" in table and "not run" in table
