"""The metrics and the printed report of `ringserve bench serve`, as `vllm bench serve` has them.

`compute_metrics` turns the per-request measurements of `bench_serve_request` into vLLM's
result fields (throughputs; mean, median, std and percentiles of TTFT, TPOT, ITL and E2EL in
milliseconds); `check_token_counts` compares every request's output tokens with what it asked
for; `format_report` prints vLLM's block and that check. Definitions follow vLLM: TTFT is the time
to the first token chunk, TPOT a request's `(E2EL - TTFT) / (output tokens - 1)`, ITL every
gap between token chunks of every request, E2EL the whole request.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from ringserve.bench.serve_request import RequestOutput

METRICS: tuple[tuple[str, str, str], ...] = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _stats(name: str, seconds: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    result = {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
        f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0,
    }
    for q in percentiles:
        result[f"p{q:g}_{name}_ms"] = percentile(ms, q)
    return result


def compute_metrics(outputs: Sequence[RequestOutput], duration: float,
                    percentiles: Sequence[float]) -> dict[str, Any]:
    """vLLM's result fields over the successful requests of a run of `duration` seconds."""
    done = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "usage_reported": all(o.usage_reported for o in done),
    }
    result.update(_stats("ttft", [o.ttft for o in done], percentiles))
    result.update(_stats("tpot", tpots, percentiles))
    result.update(_stats("itl", [gap for o in done for gap in o.itl], percentiles))
    result.update(_stats("e2el", [o.latency for o in done], percentiles))
    return result


def check_token_counts(outputs: Sequence[RequestOutput],
                       requested: Sequence[int]) -> dict[str, Any]:
    """Whether every successful request got exactly the output tokens it asked for.

    A request is a mismatch when the server's count (usage, else the token chunks) differs
    from `max_tokens`, or when the client saw more token chunks than that count (a server may
    merge tokens into one chunk, so fewer chunks is fine). Throughputs always use the counts
    the servers reported, so a short server is not credited for tokens it did not produce.
    """
    mismatched = [i for i, (o, n) in enumerate(zip(outputs, requested, strict=True))
                  if o.success and (o.output_tokens != n or o.token_chunks > o.output_tokens)]
    return {
        "requested_output_tokens": sum(n for o, n in zip(outputs, requested, strict=True)
                                       if o.success),
        "total_output_chunks": sum(o.token_chunks for o in outputs if o.success),
        "token_count_mismatches": len(mismatched),
        "token_count_mismatched_requests": mismatched[:20],
    }


def _row(label: str, value: float | int | str) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value!s:<10}"


def format_report(result: dict[str, Any], percentiles: Sequence[float],
                  max_concurrency: int | None, request_rate: float) -> str:
    """vLLM's "Serving Benchmark Result" block."""
    lines = [f"{' Serving Benchmark Result ':=^50}", _row("Successful requests:",
                                                          result["completed"])]
    if result["failed"]:
        lines.append(_row("Failed requests:", result["failed"]))
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        lines.append(_row("Request rate configured (RPS):", request_rate))
    lines += [
        _row("Benchmark duration (s):", float(result["duration"])),
        _row("Total input tokens:", result["total_input_tokens"]),
        _row("Total generated tokens:", result["total_output_tokens"]),
        _row("Request throughput (req/s):", float(result["request_throughput"])),
        _row("Output token throughput (tok/s):", float(result["output_throughput"])),
        _row("Total Token throughput (tok/s):", float(result["total_token_throughput"])),
    ]
    for key, short, title in METRICS:
        lines.append(f"{title:-^50}")
        lines.append(_row(f"Mean {short} (ms):", float(result[f"mean_{key}_ms"])))
        lines.append(_row(f"Median {short} (ms):", float(result[f"median_{key}_ms"])))
        for q in percentiles:
            lines.append(_row(f"P{q:g} {short} (ms):", float(result[f"p{q:g}_{key}_ms"])))
    if "requested_output_tokens" in result:
        lines.append(f"{' Output token check ':-^50}")
        lines.append(_row("Requested output tokens:", result["requested_output_tokens"]))
        lines.append(_row("Token chunks streamed:", result["total_output_chunks"]))
        bad = result["token_count_mismatches"]
        lines.append(_row("Requests with the wrong count:", bad))
        if bad:
            lines.append(f"!!! TOKEN COUNT MISMATCH: {bad} request(s) did not get the output "
                         f"tokens asked for (first: {result['token_count_mismatched_requests']})")
    lines.append("=" * 50)
    return "\n".join(lines)
