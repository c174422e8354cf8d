#!/usr/bin/env python3
"""A/B of `ringserve serve` between another checkout and this one, alternated (issue 17's "no
regression of the serving benchmark").

    git worktree add /tmp/old <commit>
    .venv/bin/python scripts/bench_serve_ab.py --old /tmp/old --rounds 5

Each round starts the old tree's server (its `typing/` folder, which holds `ringserve -> ../src`,
first on PYTHONPATH) and then this tree's, on the benchmark's tiny Llama, and runs the same
`ringserve bench serve` workload as scripts/bench_serve_compare.py against each (128 requests
of 128 random tokens in and 128 out, 32 at a time, --ignore-eos; token counts checked by
`bench_serve_compare.run_one`). Prints one row per server and round and the medians with
their ranges. Servers run in their own process group and are killed whatever happens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serve_compare as bsc
from ringserve.bench.throughput import bench_model_dir

KEYS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", type=Path, required=True, help="the other checkout (a worktree)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--result-dir", type=Path, default=bsc.ROOT / ".cache" / "bench_serve_ab")
    ns = p.parse_args()
    work = argparse.Namespace(input_len=128, output_len=128, num_prompts=128,
                              max_concurrency=32, seed=0)
    model = bench_model_dir()
    ns.result_dir.mkdir(parents=True, exist_ok=True)
    ringserve = str(bsc.VENV_BIN / "ringserve")
    rows: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for rnd in range(ns.rounds):
        for tree in ("old", "new"):
            env_path = str(ns.old / "typing") if tree == "old" else None
            if env_path is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = env_path
            port = bsc._free_port()
            cmd = [ringserve, "serve", model, "--port", str(port), "--device", "cpu",
                   "--disable-log-stats", "--kv-cache-memory", "256MiB"]
            load = os.getloadavg()[0]
            result = bsc.run_one(f"{tree}-{rnd}", cmd, port, model, work, ns.result_dir)
            row = {key: float(result[key]) for key in KEYS}
            rows[tree].append(row)
            print(f"ROW {tree} round {rnd} load {load:.2f} " +
                  " ".join(f"{k}={v:.1f}" for k, v in row.items()), flush=True)
    os.environ.pop("PYTHONPATH", None)
    for tree, runs in rows.items():
        print(tree + ": " + "; ".join(
            f"{k} {statistics.median(r[k] for r in runs):.1f} "
            f"({min(r[k] for r in runs):.1f}-{max(r[k] for r in runs):.1f})" for k in KEYS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
