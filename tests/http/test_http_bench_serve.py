"""`ringserve bench serve`: the client against a fake transformers serve and a live ringserve.

The fake (an `httpx.MockTransport`) speaks transformers serve's dialect: 422 for any field
outside its schema, usage in the finish chunk and no `data: [DONE]`; the benchmark must detect
it and count its tokens from the usage. The live check (slow) runs the `ringserve bench serve`
command against `ringserve serve` on the tiny Llama and reads the printed block and the saved
JSON.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_http_server import LiveServer

from ringserve.bench.serve import BenchConfig, build_parser, random_dataset, run_benchmark
from ringserve.bench.serve_metrics import (
    check_token_counts,
    compute_metrics,
    format_report,
    percentile,
)
from ringserve.bench.serve_request import RequestOutput, SampleRequest

TRANSFORMERS_FIELDS = {"model", "prompt", "temperature", "max_tokens", "stream",
                       "stream_options", "generation_config", "seed"}


def _config(tokenizer: str, **overrides: Any) -> BenchConfig:
    values: dict[str, Any] = dict(
        url="http://fake/v1/completions", base_url="http://fake", model="m",
        tokenizer=tokenizer, backend="auto", num_prompts=4, input_len=16, output_len=5,
        range_ratio=0.0, prompt_format="text", request_rate=math.inf, burstiness=1.0,
        max_concurrency=2, ignore_eos=True, seed=0, percentiles=(50.0, 99.0), api_key=None)
    values.update(overrides)
    return BenchConfig(**values)


def _transformers_like(request: httpx.Request, short: int = 0) -> httpx.Response:
    """transformers serve's dialect; `short` tokens fewer than asked for, when given."""
    body: dict[str, Any] = json.loads(request.content)
    unexpected = set(body) - TRANSFORMERS_FIELDS
    if unexpected:
        return httpx.Response(422, json={"detail": f"Unexpected fields: {unexpected}"})
    assert isinstance(body["prompt"], str)
    assert json.loads(body["generation_config"])["eos_token_id"] == -1
    n = body["max_tokens"] - short
    chunks: list[dict[str, Any]] = [{"choices": [{"index": 0, "text": f"t{i}"}]}
                                    for i in range(n)]
    chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                   "usage": {"prompt_tokens": 17, "completion_tokens": n,
                             "total_tokens": 17 + n}})
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
    return httpx.Response(200, content=sse.encode(),
                          headers={"content-type": "text/event-stream"})


async def test_detects_transformers_serve(tiny_llama_dir: Path) -> None:
    cfg = _config(str(tiny_llama_dir))
    requests = random_dataset(cfg)
    assert [r.output_len for r in requests] == [5] * 4
    assert all(isinstance(r.prompt, str) and abs(r.prompt_len - 16) <= 2 for r in requests)
    backend, outputs, duration = await run_benchmark(
        cfg, requests, transport=httpx.MockTransport(_transformers_like))
    assert backend == "transformers"
    assert all(o.success and o.usage_reported for o in outputs), [o.error for o in outputs]
    # The bare finish chunk is not a token: 5 token chunks, 4 gaps each.
    assert [(o.output_tokens, len(o.itl), o.prompt_len) for o in outputs] == [(5, 4, 17)] * 4
    assert [o.token_chunks for o in outputs] == [5] * 4
    metrics = compute_metrics(outputs, duration, cfg.percentiles)
    assert (metrics["completed"], metrics["total_output_tokens"]) == (4, 20)
    assert metrics["total_input_tokens"] == 68
    metrics.update(check_token_counts(outputs, [r.output_len for r in requests]))
    assert (metrics["requested_output_tokens"], metrics["token_count_mismatches"]) == (20, 0)
    report = format_report(metrics, cfg.percentiles, cfg.max_concurrency, cfg.request_rate)
    for label in ("Successful requests:", "P99 TTFT (ms):", "Median ITL (ms):",
                  "P50 E2EL (ms):", "Maximum request concurrency:",
                  "Requested output tokens:", "Requests with the wrong count:"):
        assert label in report
    assert "MISMATCH" not in report


async def test_a_server_short_of_tokens_is_reported_and_not_credited(
        tiny_llama_dir: Path) -> None:
    cfg = _config(str(tiny_llama_dir))
    requests = random_dataset(cfg)
    backend, outputs, duration = await run_benchmark(
        cfg, requests, transport=httpx.MockTransport(lambda r: _transformers_like(r, short=2)))
    assert backend == "transformers"
    metrics = compute_metrics(outputs, duration, cfg.percentiles)
    metrics.update(check_token_counts(outputs, [r.output_len for r in requests]))
    assert metrics["total_output_tokens"] == 12  # the tokens it produced, not the 20 asked for
    assert metrics["requested_output_tokens"] == 20
    assert metrics["token_count_mismatches"] == 4
    assert metrics["token_count_mismatched_requests"] == [0, 1, 2, 3]
    report = format_report(metrics, cfg.percentiles, cfg.max_concurrency, cfg.request_rate)
    assert "!!! TOKEN COUNT MISMATCH: 4 request(s)" in report


def test_more_chunks_than_counted_tokens_is_a_mismatch() -> None:
    good = RequestOutput(success=True, output_tokens=4, token_chunks=3)  # merged chunks: fine
    bad = RequestOutput(success=True, output_tokens=4, token_chunks=6)  # usage undercounts
    failed = RequestOutput(success=False)
    check = check_token_counts([good, bad, failed], [4, 4, 4])
    assert check["token_count_mismatches"] == 1
    assert check["token_count_mismatched_requests"] == [1]
    assert check["requested_output_tokens"] == 8


async def test_openai_backend_without_usage_counts_chunks(tiny_llama_dir: Path) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["ignore_eos"] is True and isinstance(body["prompt"], list)
        sse = "".join(f'data: {{"choices": [{{"text": "x{i}"}}]}}\n\n' for i in range(3))
        return httpx.Response(200, content=(sse + "data: [DONE]\n\n").encode())

    cfg = _config(str(tiny_llama_dir), backend="openai", prompt_format="token-ids")
    requests = random_dataset(cfg)
    assert all(len(r.prompt) == 16 for r in requests)
    backend, outputs, _ = await run_benchmark(cfg, requests, httpx.MockTransport(handler))
    assert backend == "openai"
    assert [(o.output_tokens, o.usage_reported, o.prompt_len) for o in outputs] == [
        (3, False, 16)] * 4


def test_percentile_and_flags() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    ns = build_parser().parse_args(["--num-prompts", "3"])
    assert math.isinf(ns.request_rate) and ns.max_concurrency is None
    assert ns.endpoint == "/v1/completions"
    requests = [SampleRequest("a", 1, 1)]
    assert requests[0].prompt == "a"


@pytest.mark.slow
def test_bench_serve_against_ringserve(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with LiveServer(tiny_llama_dir, tmp_path / "server.log") as server:
        run = subprocess.run(
            [sys.executable, "-m", "ringserve.cli", "bench", "serve", "--base-url", server.url,
             "--model", "tiny", "--tokenizer", str(tiny_llama_dir), "--num-prompts", "6",
             "--random-input-len", "24", "--random-output-len", "8", "--ignore-eos",
             "--max-concurrency", "3", "--request-rate", "50", "--save-result",
             "--result-dir", str(tmp_path), "--result-filename", "r.json"],
            capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    printed = dict(re.findall(r"^(.+?):\s+(\S+)\s*$", run.stdout, re.MULTILINE))
    assert printed["Successful requests"] == "6"
    assert printed["Total generated tokens"] == "48"
    for label in ("Benchmark duration (s)", "Output token throughput (tok/s)",
                  "Request throughput (req/s)", "Mean TTFT (ms)", "P99 TPOT (ms)",
                  "Median ITL (ms)", "P99 E2EL (ms)"):
        assert float(printed[label]) > 0, label
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["backend"], result["completed"], result["failed"]) == ("openai", 6, 0)
    assert result["usage_reported"] is True
    assert result["output_lens"] == [8] * 6
    # The server counts the BOS it adds; the text re-tokenizes to about 24 tokens.
    assert all(20 <= n <= 28 for n in result["input_lens"])
    assert result["total_input_tokens"] == sum(result["input_lens"])
    # One gap per chunk after the first; the server may merge tokens into one chunk when the
    # client reads slower than the engine steps (as vLLM's output collector does).
    assert all(1 <= len(itl) <= 7 for itl in result["itls"]), result["itls"]
    assert result["p99_ttft_ms"] >= result["median_ttft_ms"] > 0
