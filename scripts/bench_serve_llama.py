#!/usr/bin/env python3
"""`ringserve serve` against llama-server on the same weights, per precision (issue 48's serving
targets: 64 requests at 32 concurrent).

For each `--pair NAME=RINGSERVE_MODEL,GGUF` (a float32 or bf16 checkpoint directory, or a GGUF
file that ringserve serves as it is, beside the GGUF llama-server serves), each round starts
ringserve (`ringserve serve MODEL`, defaults, `--max-num-seqs` = the concurrency) and then
llama-server (`-t` / `-tb` --threads, `-np` = the concurrency, `-c` enough for every slot),
runs the same `ringserve bench serve` workload against each (random prompts of
`--input-len` tokens from `--tokenizer`, sent as text, `--output-len` tokens with
`ignore_eos`, `--num-prompts` requests at most `--max-concurrency` at once), and stops it.
Both servers answer under the name `bench`. The sides alternate within a round; tables give
medians of `--runs` rounds with ranges, and the ratio per round (median, range). Every
request's output token count is checked against the length asked for, by the server's usage
and by the client's count of token chunks (`bench_serve_compare.token_check`).

    .venv/bin/python scripts/bench_serve_llama.py --llama-server BIN --tokenizer DIR \\
        --pair float32=F32_DIR,F32.gguf --pair bf16=BF16_DIR,BF16.gguf \\
        --pair q4_1=Q4_1.gguf,Q4_1.gguf [--runs 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve_compare import _free_port, server, summarize, table, token_check
from ringserve.bench import serve as bench_serve

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


def run(name: str, cmd: list[str], port: int, ns: argparse.Namespace,
        result_dir: Path) -> dict[str, Any]:
    """Start one server, run the workload against it, stop it; the saved result."""
    argv = ["--port", str(port), "--model", str(ns.tokenizer), "--served-model-name", "bench",
            "--dataset-name", "random", "--random-input-len", str(ns.input_len),
            "--random-output-len", str(ns.output_len), "--num-prompts", str(ns.num_prompts),
            "--max-concurrency", str(ns.max_concurrency), "--ignore-eos", "--seed",
            str(ns.seed), "--save-result", "--result-dir", str(result_dir),
            "--result-filename", f"{name}.json"]
    print(f"\n### {name}\nserver: {shlex.join(cmd)}", flush=True)
    with server(cmd, port, result_dir / f"{name}.log"):
        status = bench_serve.main(argv)
    if status != 0:
        raise RuntimeError(f"{name}: the benchmark had failed requests")
    result: dict[str, Any] = json.loads((result_dir / f"{name}.json").read_text())
    return result


def commands(model: str, gguf: str, port: int, ns: argparse.Namespace) -> dict[str, list[str]]:
    context = ns.max_concurrency * (ns.input_len * 2 + ns.output_len + 64)
    return {
        "ringserve": [str(VENV_BIN / "ringserve"), "serve", model, "--port", str(port),
                      "--served-model-name", "bench", "--max-num-seqs",
                      str(ns.max_concurrency)],
        "llama-server": [ns.llama_server, "-m", gguf, "--port", str(port), "--alias", "bench",
                         "-t", str(ns.threads), "-tb", str(ns.threads), "-np",
                         str(ns.max_concurrency), "-c", str(context)],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", required=True)
    p.add_argument("--tokenizer", type=Path, required=True,
                   help="the model's tokenizer directory (the workload's prompts)")
    p.add_argument("--pair", action="append", required=True, metavar="NAME=MODEL,GGUF")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", type=Path, default=ROOT / ".cache" / "bench_serve_llama")
    ns = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(ns.threads)
    pairs = {}
    for item in ns.pair:
        name, _, rest = item.partition("=")
        model, _, gguf = rest.partition(",")
        if not (name and model and gguf):
            p.error(f"--pair {item!r}: expected NAME=MODEL,GGUF")
        pairs[name] = (model, gguf)
    print(f"command: {shlex.join(sys.argv)}\nload average at the start: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, (model, gguf) in pairs.items():
        rounds: list[dict[str, dict[str, Any]]] = []
        for i in range(ns.runs):
            results: dict[str, dict[str, Any]] = {}
            order = list(commands(model, gguf, 0, ns))
            if i % 2:
                order.reverse()  # alternate who goes first
            for side in order:
                port = _free_port()
                result_dir = ns.result_dir / name / f"run{i + 1}"
                result_dir.mkdir(parents=True, exist_ok=True)
                results[side] = run(side, commands(model, gguf, port, ns)[side], port, ns,
                                    result_dir)
            rounds.append({k: results[k] for k in ("ringserve", "llama-server")})
        print(f"\n## {name}: ringserve {model} / llama-server {gguf}\n")
        print(table(summarize(rounds), ns.runs))
        ratios = [r["ringserve"]["output_throughput"] / r["llama-server"]["output_throughput"]
                  for r in rounds]
        print(f"\nringserve / llama-server output tok/s: {statistics.median(ratios):.2f}x "
              f"(per round {', '.join(f'{x:.2f}' for x in ratios)})")
        print("\n".join(token_check(rounds)))
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
