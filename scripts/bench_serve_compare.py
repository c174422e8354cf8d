#!/usr/bin/env python3
"""ringserve serve vs transformers serve --continuous-batching, one workload, one run (issue 8).

Starts each server in turn on the benchmark's tiny Llama (loopback only, HF_HUB_OFFLINE=1),
runs `ringserve bench serve` against it with the same flags, stops it, and saves each result
JSON under --result-dir; then prints the comparison table with the issue's targets and draws
docs/bench_serve.png (output throughput; TTFT and ITL median and P99). Servers run in their
own process group and are killed in `finally`, however the run ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from ringserve.engine.bench_throughput import bench_model_dir
from ringserve.http import bench_serve

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
TUNED_CB = "--cb-num-blocks 64 --cb-max-batch-tokens 1024"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def server(cmd: list[str], port: int, log: Path, ready_s: float = 300.0) -> Iterator[None]:
    """A server subprocess (own session), ready on /health; its group is killed on exit."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} not ready in {ready_s} s; see {log}")
            time.sleep(0.2)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_one(name: str, cmd: list[str], port: int, model: str, ns: argparse.Namespace,
            result_dir: Path) -> dict[str, Any]:
    """Start one server, benchmark it, stop it; returns the saved result."""
    argv = ["--port", str(port), "--model", model, "--dataset-name", "random",
            "--random-input-len", str(ns.input_len), "--random-output-len", str(ns.output_len),
            "--num-prompts", str(ns.num_prompts), "--max-concurrency", str(ns.max_concurrency),
            "--ignore-eos", "--seed", str(ns.seed), "--save-result",
            "--result-dir", str(result_dir), "--result-filename", f"{name}.json"]
    print(f"\n### {name}\nserver: {shlex.join(cmd)}\nbench:  ringserve bench serve "
          f"{shlex.join(argv)}", flush=True)
    with server(cmd, port, result_dir / f"{name}.log"):
        status = bench_serve.main(argv)
    if status != 0:
        raise RuntimeError(f"{name}: the benchmark had failed requests")
    result: dict[str, Any] = json.loads((result_dir / f"{name}.json").read_text())
    result["server_command"] = shlex.join(cmd)
    (result_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def table(results: dict[str, dict[str, Any]]) -> str:
    """The markdown comparison table."""
    rows = ["| server | output tok/s | req/s | TTFT median / P99 (ms) | ITL median / P99 (ms) "
            "| TPOT median (ms) | E2EL median (ms) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        rows.append(f"| {name} | {r['output_throughput']:.1f} | {r['request_throughput']:.2f} "
                    f"| {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} "
                    f"| {r['median_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} "
                    f"| {r['median_tpot_ms']:.1f} | {r['median_e2el_ms']:.0f} |")
    return "\n".join(rows)


def targets(results: dict[str, dict[str, Any]]) -> str:
    """Issue 8's targets against the best transformers serve configuration."""
    ours = results["ringserve"]
    lines = []
    for name, r in results.items():
        if name == "ringserve":
            continue
        ratio = ours["output_throughput"] / r["output_throughput"]
        lower = ours["p99_ttft_ms"] < r["p99_ttft_ms"]
        lines.append(f"vs {name}: {ratio:.2f}x output throughput (target >= 2x: "
                     f"{'met' if ratio >= 2 else 'NOT met'}); P99 TTFT {ours['p99_ttft_ms']:.0f} "
                     f"vs {r['p99_ttft_ms']:.0f} ms (lower: {'met' if lower else 'NOT met'})")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """Output throughput bars, and TTFT / ITL median and P99 bars, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"][:len(names)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    labels = [n.replace(" (", "\n(") for n in names]
    bars = axes[0].bar(labels, [results[n]["output_throughput"] for n in names], color=colors)
    axes[0].bar_label(bars, fmt="%.0f")
    axes[0].set_title("Output token throughput (tok/s, higher is better)")
    for ax, metric in ((axes[1], "ttft"), (axes[2], "itl")):
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            values = [results[n][f"median_{metric}_ms"], results[n][f"p99_{metric}_ms"]]
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(2)]
            ax.bar_label(ax.bar(xs, values, width, label=n, color=colors[i]), fmt="%.0f",
                         fontsize=8)
        ax.set_xticks([0, 1], ["median", "P99"])
        ax.set_title(f"{metric.upper()} (ms, lower is better)")
        ax.legend(fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tuned-cb", default=TUNED_CB,
                   help=f"transformers serve CB flags of the tuned run ('' to skip; "
                   f"default: {TUNED_CB})")
    p.add_argument("--ringserve-args", default="--kv-cache-memory 256MiB",
                   help="extra ringserve serve flags")
    p.add_argument("--result-dir", type=Path, default=ROOT / ".cache" / "bench_serve")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "bench_serve.png")
    p.add_argument("--from-results", action="store_true",
                   help="start nothing: table and plot from the JSON files in --result-dir")
    ns = p.parse_args()
    model = bench_model_dir()
    ns.result_dir.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"python": platform.python_version(), "cpus": os.cpu_count(),
                      "kernel": platform.release(), "command": shlex.join(sys.argv)}))
    port = _free_port()
    ts = [str(VENV_BIN / "transformers"), "serve", "--continuous-batching", "--device", "cpu",
          "--host", "127.0.0.1", "--port", str(port)]
    runs = {
        "ringserve": [str(VENV_BIN / "ringserve"), "serve", model, "--port", str(port),
                      "--device", "cpu", "--disable-log-stats", *shlex.split(ns.ringserve_args)],
        "transformers serve (defaults)": ts,
    }
    if ns.tuned_cb:
        runs["transformers serve (tuned)"] = [*ts, *shlex.split(ns.tuned_cb)]
    results: dict[str, dict[str, Any]] = {}
    for name, cmd in runs.items():
        slug = name.replace(" serve", "").replace(" (", "-").rstrip(")")
        if ns.from_results:
            results[name] = json.loads((ns.result_dir / f"{slug}.json").read_text())
        else:
            results[name] = run_one(slug, cmd, port, model, ns, ns.result_dir)
    print("\n" + table(results) + "\n\n" + targets(results))
    plot(results, ns.plot, f"{ns.num_prompts} prompts, random {ns.input_len} in / "
         f"{ns.output_len} out, max concurrency {ns.max_concurrency}, tiny Llama on "
         f"{os.cpu_count()} CPUs")
    print(f"plot: {ns.plot}\nresults: {ns.result_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
