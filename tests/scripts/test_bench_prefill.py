"""The prefill benchmarks' plain helpers (scripts/bench_prefill.py, bench_prefill_attention.py,
cpu_bench.py): the CPU line, the interleaving order, median (range) and ratio cells, case and
flag parsing, and the per-request checks that make a ringserve or llama-server sample count."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load(name: str) -> ModuleType:
    if str(SCRIPTS) not in sys.path:  # the scripts import cpu_bench as a sibling module
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse avx2 fma avx512f avx512_bf16
processor\t: 1
model name\t: other
flags\t\t: fpu
"""


def test_cpu_line_names_the_first_cpu_and_the_kernel_flags() -> None:
    cpu = _load("cpu_bench")
    model, flags = cpu.parse_cpuinfo(CPUINFO)
    assert model == "AMD EPYC 9R14" and {"avx2", "avx512_bf16"} <= flags and "fpu" in flags
    text = cpu.flags_text(flags)
    assert "avx512f yes" in text and "avx512_bf16 yes" in text and "amx_bf16 no" in text
    assert cpu.parse_cpuinfo("") == ("unknown CPU", set())


def test_rounds_rotate_and_cells_show_median_and_range() -> None:
    cpu = _load("cpu_bench")
    sides = ("a", "b", "c")
    assert [cpu.rotated(sides, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert cpu.median_range([3.0, 1.0, 2.0]) == "2.0 (1.0-3.0)"
    assert cpu.median_range([1500.4, 1200.0, 2400.0], 0, thousands=True) == "1,500 (1,200-2,400)"


def test_attention_cases_parse_and_read() -> None:
    attention = _load("bench_prefill_attention")
    assert attention.parse_cases("512:0, 2048:2048") == [(512, 0), (2048, 2048)]
    for bad in ("512", "0:0", "a:1", "512:-1"):
        with pytest.raises(ValueError, match="N:CTX"):
            attention.parse_cases(bad)
    assert attention.case_label(4096, 0) == "4,096 fresh"
    assert attention.case_label(2048, 2048) == "2,048 after 2,048"


def _ringserve_output(generated: int, prompt: int, cached: int) -> Any:
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(generated)))],
                           prompt_token_ids=list(range(prompt)), num_cached_tokens=cached)


def test_a_ringserve_sample_counts_only_one_cold_token_after_the_whole_prompt() -> None:
    prefill = _load("bench_prefill")
    prefill.check_ringserve([_ringserve_output(1, 512, 0)], 512)
    for generated, prompt, cached in ((2, 512, 0), (1, 511, 0), (1, 512, 16)):
        with pytest.raises(RuntimeError, match=r"expected \(1, 512, 0\)"):
            prefill.check_ringserve([_ringserve_output(generated, prompt, cached)], 512)
    with pytest.raises(RuntimeError, match="2 outputs"):
        prefill.check_ringserve([_ringserve_output(1, 512, 0)] * 2, 512)


def test_a_llama_server_sample_needs_one_token_after_the_prompt() -> None:
    prefill = _load("bench_prefill")
    prefill.check_llama({"tokens_predicted": 1, "timings": {"prompt_n": 512}}, 512)
    prefill.check_llama({"tokens_predicted": 1, "timings": {"prompt_n": 513}}, 512)  # + BOS
    for bad in ({"tokens_predicted": 2, "timings": {"prompt_n": 512}},
                {"tokens_predicted": 1, "timings": {"prompt_n": 100}}, {}):
        with pytest.raises(RuntimeError, match="llama-server"):
            prefill.check_llama(bad, 512)


def test_table_ratios_are_per_round() -> None:
    prefill = _load("bench_prefill")
    tok = prefill.TOK_S
    results = {
        "ringserve": {512: [{tok: 600.0}, {tok: 300.0}, {tok: 500.0}]},
        "transformers": {512: [{tok: 300.0}, {tok: 300.0}, {tok: 1000.0}]},
    }
    lines = prefill.table(results, [512])
    assert lines[0] == ("| prompt tokens | ringserve tok/s | transformers tok/s | "
                        "ringserve / transformers |")
    # Per round: 2.0, 1.0, 0.5 (median 1.0), not the ratio of the medians (500 / 300).
    assert lines[2] == "| 512 | 500 (300-600) | 300 (300-1,000) | 1.00x (0.50-2.00) |"
    results["llama-server"] = {512: [{tok: 300.0, prefill.SERVER_TOK_S: 400.0}] * 3}
    lines = prefill.table(results, [512])
    assert "llama-server tok/s (its timings)" in lines[0] and lines[2].endswith(
        "| 400 (400-400) | 300 (300-300) | 1.67x (1.00-2.00) |")


def test_gguf_flags_name_one_file_for_every_dtype_or_one_per_dtype(tmp_path: Path) -> None:
    prefill = _load("bench_prefill")
    f32, bf16 = tmp_path / "m-F32.gguf", tmp_path / "m-BF16.gguf"
    f32.write_bytes(b"GGUF")
    bf16.write_bytes(b"GGUF")
    both = ["float32", "bfloat16"]
    assert prefill.parse_gguf_flags([str(f32)], both) == {"float32": f32, "bfloat16": f32}
    assert prefill.parse_gguf_flags([f"float32={f32}", f"bfloat16={bf16}"], both) == {
        "float32": f32, "bfloat16": bf16}
    with pytest.raises(ValueError, match="no such file"):
        prefill.parse_gguf_flags([str(tmp_path / "missing.gguf")], both)
