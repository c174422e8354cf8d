#!/usr/bin/env python3
"""ringserve serve vs transformers serve --continuous-batching, one workload, `--runs` rounds (issue 8).

Each round starts each server in turn on the benchmark's tiny Llama (loopback only,
HF_HUB_OFFLINE=1), runs `ringserve bench serve` against it with the same flags, stops it, and
saves each result JSON under --result-dir (`<server>-run<i>.json`). Every server's output token
counts are checked per request against the `max_tokens` asked for (`bench_serve_metrics.
check_token_counts`: the server's usage, and the client's own count of token chunks); a
mismatch is printed loudly and the throughputs use the counts the servers reported. The table
gives the median of the rounds with the range, the ratios are per round (same round, same
load) with their median and range; docs/bench_serve.png draws the medians with range bars.
Servers run in their own process group and are killed in `finally`, however the run ends.
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
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from ringserve.bench import serve as bench_serve
from ringserve.bench.throughput import bench_model_dir

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


METRICS = ("output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms",
           "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "median_e2el_ms")


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, tuple[float, float, float]]]:
    """(median, min, max) over the rounds of every metric of every server."""
    return {name: {m: (statistics.median(v := [r[name][m] for r in rounds]), min(v), max(v))
                   for m in METRICS} for name in rounds[0]}


def token_check(rounds: list[dict[str, dict[str, Any]]]) -> list[str]:
    """One line per server and round: requested vs reported tokens vs token chunks."""
    lines = []
    for i, results in enumerate(rounds, 1):
        for name, r in results.items():
            bad = r.get("token_count_mismatches")
            if bad is None:  # a result saved before the check existed: recompute it
                want = r.get("requested_output_lens") or [r["random_output_len"]] * len(r["output_lens"])
                bad = sum(1 for got, n in zip(r["output_lens"], want, strict=True) if got != n)
            verdict = "ok" if bad == 0 else f"!!! TOKEN COUNT MISMATCH in {bad} requests"
            lines.append(f"round {i}, {name}: requested {r.get('requested_output_tokens', '?')}, "
                         f"server reported {r['total_output_tokens']}, token chunks "
                         f"{r.get('total_output_chunks', '?')}: {verdict}")
    return lines


def _cell(v: tuple[float, float, float], fmt: str) -> str:
    return f"{v[0]:{fmt}} ({v[1]:{fmt}}-{v[2]:{fmt}})"


def table(summary: dict[str, dict[str, tuple[float, float, float]]], runs: int) -> str:
    """The markdown comparison table: medians of the rounds, ranges in brackets."""
    rows = [f"| server (median of {runs}, range) | output tok/s | req/s | TTFT median / P99 (ms) "
            "| ITL median / P99 (ms) | TPOT median (ms) | E2EL median (ms) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in summary.items():
        rows.append(f"| {name} | {_cell(r['output_throughput'], ',.0f')} "
                    f"| {_cell(r['request_throughput'], '.2f')} "
                    f"| {_cell(r['median_ttft_ms'], '.0f')} / {_cell(r['p99_ttft_ms'], '.0f')} "
                    f"| {_cell(r['median_itl_ms'], '.1f')} / {_cell(r['p99_itl_ms'], '.1f')} "
                    f"| {_cell(r['median_tpot_ms'], '.1f')} | {_cell(r['median_e2el_ms'], '.0f')} |")
    return "\n".join(rows)


def targets(rounds: list[dict[str, dict[str, Any]]]) -> str:
    """Issue 8's targets per baseline: ratios taken within each round, median and range."""
    lines = []
    for name in rounds[0]:
        if name == "ringserve":
            continue
        ratios = [r["ringserve"]["output_throughput"] / r[name]["output_throughput"] for r in rounds]
        lower = sum(r["ringserve"]["p99_ttft_ms"] < r[name]["p99_ttft_ms"] for r in rounds)
        ratio = statistics.median(ratios)
        lines.append(f"vs {name}: {ratio:.2f}x output throughput (per round: "
                     f"{', '.join(f'{x:.2f}' for x in ratios)}; range {min(ratios):.2f}-"
                     f"{max(ratios):.2f}; target >= 2x on the median: "
                     f"{'met' if ratio >= 2 else 'NOT met'}); P99 TTFT lower in {lower} of "
                     f"{len(rounds)} rounds")
    return "\n".join(lines)


def plot(summary: dict[str, dict[str, tuple[float, float, float]]], path: Path, title: str) -> None:
    """Output throughput bars, and TTFT / ITL median and P99 bars: medians, range as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def bars(ax: Any, xs: list[float], values: list[tuple[float, float, float]], **kw: Any) -> None:
        med = [v[0] for v in values]
        err = [[v[0] - v[1] for v in values], [v[2] - v[0] for v in values]]
        ax.bar_label(ax.bar(xs, med, yerr=err, capsize=4, **kw), fmt="%.0f", fontsize=8,
                     padding=2)

    names = list(summary)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"][:len(names)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    labels = [n.replace(" (", "\n(") for n in names]
    bars(axes[0], list(range(len(names))), [summary[n]["output_throughput"] for n in names],
         color=colors)
    axes[0].set_xticks(list(range(len(names))), labels)
    axes[0].set_title("Output token throughput (tok/s, higher is better)")
    for ax, metric in ((axes[1], "ttft"), (axes[2], "itl")):
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(2)]
            bars(ax, xs, [summary[n][f"median_{metric}_ms"], summary[n][f"p99_{metric}_ms"]],
                 width=width, label=n, color=colors[i])
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


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for pkg in ("ringserve", "torch", "transformers", "fastapi", "uvicorn", "accelerate",
                "httpx", "trio"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=3,
                   help="rounds (each starts and benchmarks every server once); medians and "
                   "ranges are reported")
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
    if ns.runs < 1:
        p.error("--runs must be >= 1")
    model = bench_model_dir()
    ns.result_dir.mkdir(parents=True, exist_ok=True)
    cpu = "?"
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(ln.split(":", 1)[1].strip()
                   for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    print(json.dumps({"python": platform.python_version(), "cpu": cpu, "cpus": os.cpu_count(),
                      "kernel": platform.release(), "load_average": os.getloadavg(),
                      **_versions(), "command": shlex.join(sys.argv)}))
    port = _free_port()
    ts = [str(VENV_BIN / "transformers"), "serve", "--continuous-batching", "--device", "cpu",
          "--host", "127.0.0.1", "--port", str(port)]
    servers = {
        "ringserve": [str(VENV_BIN / "ringserve"), "serve", model, "--port", str(port),
                      "--device", "cpu", "--disable-log-stats", *shlex.split(ns.ringserve_args)],
        "transformers serve (defaults)": ts,
    }
    if ns.tuned_cb:
        servers["transformers serve (tuned)"] = [*ts, *shlex.split(ns.tuned_cb)]
    rounds: list[dict[str, dict[str, Any]]] = []
    for i in range(1, ns.runs + 1):
        results: dict[str, dict[str, Any]] = {}
        for name, cmd in servers.items():
            slug = name.replace(" serve", "").replace(" (", "-").rstrip(")") + f"-run{i}"
            if ns.from_results:
                results[name] = json.loads((ns.result_dir / f"{slug}.json").read_text())
            else:
                print(f"\n## round {i} of {ns.runs} (load average {os.getloadavg()[0]:.2f})")
                results[name] = run_one(slug, cmd, port, model, ns, ns.result_dir)
        rounds.append(results)
    summary = summarize(rounds)
    checks = token_check(rounds)
    print("\noutput token counts (every request vs its max_tokens):\n" + "\n".join(checks))
    if any("MISMATCH" in line for line in checks):
        print("\n!!! at least one server did not produce the tokens asked for; the throughputs "
              "below use the counts the servers reported")
    print("\n" + table(summary, ns.runs) + "\n\n" + targets(rounds))
    plot(summary, ns.plot, f"{ns.num_prompts} prompts, random {ns.input_len} in / "
         f"{ns.output_len} out, max concurrency {ns.max_concurrency}, tiny Llama on "
         f"{os.cpu_count()} CPUs; median of {ns.runs} rounds, bars: range")
    print(f"plot: {ns.plot}\nresults: {ns.result_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
