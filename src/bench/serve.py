"""`ringserve bench serve`: load-test an OpenAI-compatible server, as `vllm bench serve` does.

A pure HTTP client (httpx on trio) that imports no server code, so the same workload runs
against `ringserve serve`, vLLM or `transformers serve --continuous-batching`. It builds the
random dataset (prompts of `--random-input-len` tokens from the model's tokenizer), sends
streamed `/v1/completions` requests with Poisson arrivals (`--request-rate`, inf by default)
under `--max-concurrency`, and prints vLLM's result block (`bench_serve_metrics`); with
`--save-result` it writes vLLM's JSON. The server dialect (`--backend`) is detected by the
initial test request: a 422 to vLLM's fields means transformers serve (`bench_serve_request`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import trio

from ringserve.bench.serve_metrics import check_token_counts, compute_metrics, format_report
from ringserve.bench.serve_request import (
    BACKENDS,
    Backend,
    RequestOutput,
    SampleRequest,
    build_payload,
    send_request,
)


@dataclass(frozen=True)
class BenchConfig:
    """The benchmark's settings, built once from the command line."""

    url: str
    base_url: str
    model: str
    tokenizer: str
    backend: str
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float
    prompt_format: str
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    ignore_eos: bool
    seed: int
    percentiles: tuple[float, ...]
    api_key: str | None


def _load_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"no tokenizer.json in {path!r}; pass a local model directory as "
                         "--model or --tokenizer")
    return Tokenizer.from_file(str(file))


def _prompt_text(tokenizer: Any, ids: list[int], target: int, candidates: list[int],
                 rng: random.Random) -> tuple[str, int]:
    """Text that re-tokenizes to `target` tokens (or close), as vLLM's random dataset makes."""
    text, length = "", 0
    for _ in range(10):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        ids = list(tokenizer.encode(text, add_special_tokens=False).ids)
        length = len(ids)
        if length == target:
            break
        ids = ids[:target] + [rng.choice(candidates) for _ in range(target - length)]
    return text, length


def random_dataset(cfg: BenchConfig) -> list[SampleRequest]:
    """`num_prompts` random prompts (no special tokens) and their output lengths."""
    tokenizer = _load_tokenizer(cfg.tokenizer)
    special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
    candidates = [i for i in range(tokenizer.get_vocab_size()) if i not in special]
    rng = random.Random(cfg.seed)

    def length(mean: int) -> int:
        low, high = math.floor(mean * (1 - cfg.range_ratio)), math.ceil(mean * (1 + cfg.range_ratio))
        return max(1, rng.randint(low, high))

    requests = []
    for _ in range(cfg.num_prompts):
        target, out_len = length(cfg.input_len), length(cfg.output_len)
        ids = [rng.choice(candidates) for _ in range(target)]
        if cfg.prompt_format == "token-ids":
            requests.append(SampleRequest(ids, target, out_len))
        else:
            text, prompt_len = _prompt_text(tokenizer, ids, target, candidates, rng)
            requests.append(SampleRequest(text, prompt_len, out_len))
    return requests


async def _arrivals(requests: Sequence[SampleRequest], rate: float, burstiness: float,
                    rng: random.Random) -> AsyncIterator[tuple[int, SampleRequest]]:
    """The requests at Poisson (gamma, for burstiness != 1) arrival times."""
    for index, request in enumerate(requests):
        yield index, request
        if not math.isinf(rate):
            await trio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))


async def _initial_test(client: httpx.AsyncClient, cfg: BenchConfig, request: SampleRequest,
                        headers: dict[str, str]) -> Backend:
    """Send the first prompt once (untimed: loads lazy servers); returns the working dialect."""
    tried: list[Backend] = [b for b in BACKENDS if cfg.backend in ("auto", b)]
    for backend in tried:
        payload = build_payload(backend, cfg.model, request, cfg.ignore_eos)
        out = await send_request(client, cfg.url, payload, request.prompt_len, headers)
        if out.success:
            return backend
        if not (cfg.backend == "auto" and out.status == 422):
            break
    raise ValueError(f"initial test run failed ({cfg.url}): {out.error}")


async def run_benchmark(cfg: BenchConfig, requests: Sequence[SampleRequest],
                        transport: httpx.AsyncBaseTransport | None = None,
                        ) -> tuple[Backend, list[RequestOutput], float]:
    """The dialect, every request's measurements (in order) and the duration in seconds.

    `transport` replaces the network (tests pass an `httpx.MockTransport`).
    """
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    outputs = [RequestOutput() for _ in requests]
    async with httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0), limits=limits,
                                 transport=transport) as client:
        print("Starting initial single prompt test run...")
        backend = await _initial_test(client, cfg, requests[0], headers)
        print(f"Initial test run completed (backend: {backend}). Starting main benchmark run...")
        limiter = trio.CapacityLimiter(cfg.max_concurrency or len(requests))

        async def one(index: int, request: SampleRequest) -> None:
            async with limiter:
                payload = build_payload(backend, cfg.model, request, cfg.ignore_eos)
                outputs[index] = await send_request(client, cfg.url, payload,
                                                    request.prompt_len, headers)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            async for index, request in _arrivals(requests, cfg.request_rate, cfg.burstiness,
                                                  random.Random(cfg.seed)):
                nursery.start_soon(one, index, request)
        duration = time.perf_counter() - start
    return backend, outputs, duration


def _served_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0).json()
    return str(models["data"][0]["id"])


def build_parser() -> argparse.ArgumentParser:
    """The flags of `vllm bench serve` that apply here, plus `--backend` and `--prompt-format`."""
    p = argparse.ArgumentParser(prog="ringserve bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["auto", *BACKENDS], default="auto",
                   help="server dialect: openai (vLLM, ringserve) or transformers "
                   "(transformers serve); auto: openai, else transformers on a 422")
    p.add_argument("--base-url", help="server URL (overrides --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions"])
    p.add_argument("--model", help="model name in requests and default tokenizer directory "
                   "(default: the first of GET /v1/models)")
    p.add_argument("--served-model-name", help="model name in requests (default: --model)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    p.add_argument("--dataset-name", choices=["random"], default="random")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    p.add_argument("--prompt-format", choices=["text", "token-ids"], default="text",
                   help="send decoded text (any server) or token ids (vLLM, ringserve)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    return p


def config_from_args(ns: argparse.Namespace) -> BenchConfig:
    """Validate the flags and build the config (asks the server for the model if unnamed)."""
    for flag in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(ns, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not 0.0 <= ns.random_range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    if ns.request_rate <= 0 or ns.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    base_url = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    model = ns.model or _served_model(base_url, ns.api_key)
    return BenchConfig(
        url=base_url + ns.endpoint, base_url=base_url, model=ns.served_model_name or model,
        tokenizer=ns.tokenizer or model, backend=ns.backend, num_prompts=ns.num_prompts,
        input_len=ns.random_input_len, output_len=ns.random_output_len,
        range_ratio=ns.random_range_ratio, prompt_format=ns.prompt_format,
        request_rate=ns.request_rate, burstiness=ns.burstiness,
        max_concurrency=ns.max_concurrency, ignore_eos=ns.ignore_eos, seed=ns.seed,
        percentiles=tuple(float(q) for q in ns.metric_percentiles.split(",")),
        api_key=ns.api_key)


def result_json(cfg: BenchConfig, backend: Backend, metrics: dict[str, Any],
                outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """vLLM's saved result: the settings, the metrics and the per-request lists."""
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": backend,
        "base_url": cfg.base_url, "model_id": cfg.model, "tokenizer_id": cfg.tokenizer,
        "num_prompts": cfg.num_prompts, "random_input_len": cfg.input_len,
        "random_output_len": cfg.output_len, "prompt_format": cfg.prompt_format,
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency,
        "ignore_eos": cfg.ignore_eos, "seed": cfg.seed,
        "python": platform.python_version(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "command": " ".join(sys.argv),
        **metrics,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens for o in outputs],
        "output_chunks": [o.token_chunks for o in outputs],
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }


def save_result(cfg: BenchConfig, result: dict[str, Any], directory: str,
                filename: str | None) -> Path:
    """Write the result JSON (vLLM's default file name) and return its path."""
    if filename is None:
        rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
        filename = (f"{result['backend']}-{rate}qps-concurrency{cfg.max_concurrency}-"
                    f"{Path(cfg.model).name}-{result['date']}.json")
    path = Path(directory) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from the command line; returns the exit status."""
    ns = build_parser().parse_args(argv)
    cfg = config_from_args(ns)
    print(json.dumps({"python": platform.python_version(), "machine": platform.machine(),
                      "cpus": os.cpu_count(), "kernel": platform.release(),
                      "httpx": httpx.__version__, "trio": trio.__version__,
                      "command": " ".join(sys.argv)}))
    requests = random_dataset(cfg)
    backend, outputs, duration = trio.run(run_benchmark, cfg, requests)
    metrics = compute_metrics(outputs, duration, cfg.percentiles)
    metrics.update(check_token_counts(outputs, [r.output_len for r in requests]))
    metrics["requested_output_lens"] = [r.output_len for r in requests]
    print(format_report(metrics, cfg.percentiles, cfg.max_concurrency, cfg.request_rate))
    for error in sorted({o.error for o in outputs if o.error})[:5]:
        print(f"error: {error}", file=sys.stderr)
    if ns.save_result:
        path = save_result(cfg, result_json(cfg, backend, metrics, outputs), ns.result_dir,
                           ns.result_filename)
        print(f"result saved to {path}")
    return 0 if metrics["failed"] == 0 else 1
