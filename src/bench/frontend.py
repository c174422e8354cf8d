"""`ringserve bench frontend` (scripts/bench_frontend.py): frontend cost per output token.

256 concurrent streams, each producing 128 tokens of multilingual text (accented Latin, CJK,
emoji) one token per step with two stop strings that never match, fed as EngineCoreOutputs to
the real OutputProcessor with one collector per request, the consumer draining each collector
every step. Compared in the same run with the O(n^2) way: re-decode each request's whole output
every step, search the whole text for the stop strings, and slice the delta. Reports µs per
output token for both and their ratio: `--runs` rounds (default 3), both paths once per round,
the median and the range (never the best round alone). Prints the machine, versions, the
command and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

STREAMS = 256
TOKENS = 128
STOPS = ["<never-1>", "\n\n\n###"]
TEXT = ("Le café naïve à Noël — 你好 世界 今天天气很好 👋🎉 and the quick brown fox "
        "jumps over the lazy dog; Größere Äpfel schmecken süß. ")


def _streams(tokenizer: Any) -> list[list[int]]:
    ids = list(tokenizer(TEXT * 40, add_special_tokens=False).input_ids)
    return [ids[(i * 7) % 200:(i * 7) % 200 + TOKENS] for i in range(STREAMS)]


def run_incremental(tokenizer: Any, streams: list[list[int]]) -> float:
    """Seconds for OutputProcessor + collectors over every step."""
    import trio

    from ringserve.engine.frontend.collector import RequestOutputCollector
    from ringserve.engine.frontend.output_processor import OutputProcessor
    from ringserve.engine.wire import EngineCoreOutput, EngineCoreRequest, FinishReason
    from ringserve.sampling_params import RequestOutputKind, SamplingParams

    async def body() -> float:
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(stop=STOPS, max_tokens=TOKENS,
                                output_kind=RequestOutputKind.DELTA)
        collectors = []
        for i in range(STREAMS):
            collector = RequestOutputCollector(params.output_kind)
            request = EngineCoreRequest(f"r{i}", [1, 2, 3], params, time.time())
            processor.add_request(request, None, queue=collector)
            collectors.append(collector)
        start = time.perf_counter()
        for step in range(TOKENS):
            last = step == TOKENS - 1
            outs = [EngineCoreOutput(f"r{i}", [streams[i][step]],
                                     finish_reason=FinishReason.LENGTH if last else None)
                    for i in range(STREAMS)]
            processor.process_outputs(outs)
            for collector in collectors:
                collector.get_nowait()
        return time.perf_counter() - start

    return trio.run(body)


def run_redecode(tokenizer: Any, streams: list[list[int]]) -> float:
    """Seconds for the O(n^2) way: full decode + full stop search + delta slice per step."""
    texts = [""] * STREAMS
    start = time.perf_counter()
    for step in range(TOKENS):
        for i in range(STREAMS):
            text = tokenizer.decode(streams[i][:step + 1], skip_special_tokens=True)
            if any(stop in text for stop in STOPS):
                raise RuntimeError("unexpected stop")
            _delta = text[len(texts[i]):]
            texts[i] = text
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints a table and a JSON line."""
    parser = argparse.ArgumentParser(prog="ringserve bench frontend", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="rounds; medians and ranges reported")
    ns = parser.parse_args(argv)
    if ns.runs < 1:
        parser.error("--runs must be >= 1")
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    from ringserve.gpu.testing import demo_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_path()))
    streams = _streams(tokenizer)
    total = STREAMS * TOKENS
    run_incremental(tokenizer, streams)  # warm-up
    inc, red = [], []
    for _ in range(ns.runs):
        inc.append(run_incremental(tokenizer, streams) / total * 1e6)
        red.append(run_redecode(tokenizer, streams) / total * 1e6)
    ratios = [r / i for i, r in zip(inc, red, strict=True)]

    def span(v: list[float]) -> str:
        return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"

    print(json.dumps({"python": platform.python_version(), "machine": platform.machine(),
                      "cores": os.cpu_count(), "load_average": os.getloadavg(),
                      "tokenizers": tokenizers.__version__,
                      "transformers": transformers.__version__, "command": " ".join(sys.argv)}))
    print(f"\n{STREAMS} streams x {TOKENS} tokens, median of {ns.runs} rounds (range)\n")
    print("| frontend path | us per output token |\n|---|---:|")
    print(f"| ringserve (incremental detokenizer + stop check + collector) | {span(inc)} |")
    print(f"| re-decode whole text each step (O(n^2)) | {span(red)} |")
    print(f"\nspeed-up per round: {', '.join(f'{r:.1f}' for r in ratios)}; median {span(ratios)}x")
    print(json.dumps({"bench": "frontend", "streams": STREAMS, "tokens": TOKENS,
                      "incremental_us_per_token": statistics.median(inc),
                      "redecode_us_per_token": statistics.median(red),
                      "incremental_runs": inc, "redecode_runs": red}))
    return 0
