#!/usr/bin/env python3
"""Benchmark one sampling step over a large vocabulary (issue 17, item 3).

Times `ringserve.gpu.sample.sampler.Sampler.forward` on random float32 logits [B, V] (V = 49152 by
default, SmolLM-135M's vocabulary) with metadata built through the real request table, for
each batch size and each case:

  (a) greedy; (b) temperature 0.8 + top-k 50; (c) top-p 0.9; (d) top-k 50 + top-p 0.9;
  (e) greedy with logprobs=5; (f) as (d) with a seed per request (per-row generators).

Each timed call gets a fresh copy of the logits (made outside the clock: the sampler may edit
the runner's logits in place). As the same-run baseline, the script also times one `max` pass
over the same logits (the least any sampler must read) and the tied LM head of a
SmolLM-135M-shaped model (hidden 576 -> V, float32), so the sampler can be read as a multiple
of the pass that produced its input. Prints the machine, versions, the command and a markdown
table (median of `--reps` with the range, in ms).

    .venv/bin/python scripts/bench_sampler.py [--batch 1,8,64] [--vocab 49152] [--threads 2]
        [--reps 9] [--cases a,b,c,d,e,f]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from ringserve.gpu.runner.request_state import RequestTable
from ringserve.gpu.sample.sampler import Sampler
from ringserve.gpu.sample.sampling_metadata import SamplingMetadata, build_sampling_metadata
from ringserve.gpu.wire import NewRequestData
from ringserve.sampling_params import SamplingParams

HIDDEN = 576
CASES: dict[str, tuple[str, Callable[[int], SamplingParams]]] = {
    "a": ("greedy", lambda i: SamplingParams(temperature=0.0)),
    "b": ("temperature 0.8 + top-k 50", lambda i: SamplingParams(temperature=0.8, top_k=50)),
    "c": ("top-p 0.9", lambda i: SamplingParams(temperature=0.8, top_p=0.9)),
    "d": ("top-k 50 + top-p 0.9",
          lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.9)),
    "e": ("greedy + logprobs=5", lambda i: SamplingParams(temperature=0.0, logprobs=5)),
    "f": ("top-k 50 + top-p 0.9, seeded",
          lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1000 + i)),
}


def _metadata(params: list[SamplingParams], vocab: int) -> SamplingMetadata:
    table = RequestTable(max_num_reqs=len(params), max_model_len=16, block_size=16,
                         eos_token_ids=(0,), device=torch.device("cpu"))
    for i, p in enumerate(params):
        table.apply_new(NewRequestData(f"r{i}", [1, 2, 3], p, [0], 0, []))
    return build_sampling_metadata(table, np.arange(len(params)), vocab, torch.device("cpu"))


def _time(fn: Callable[[torch.Tensor], object], logits: torch.Tensor, reps: int) -> list[float]:
    fn(logits.clone())  # warm-up
    times = []
    for _ in range(reps):
        fresh = logits.clone()
        start = time.perf_counter()
        fn(fresh)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _cell(times: list[float]) -> str:
    return f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})"


def main() -> None:
    """Parse the flags, time every (batch, case) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", default="1,8,64")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--cases", default="a,b,c,d,e,f")
    args = parser.parse_args()
    if args.reps < 5:
        raise ValueError(f"--reps must be >= 5 (a median of at least 5), got {args.reps}")
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    cases = args.cases.split(",")
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} "
          f"threads={args.threads}; python {sys.version.split()[0]}, torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("command: .venv/bin/python " + " ".join(sys.argv))
    sampler = Sampler()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, HIDDEN, generator=gen) * 0.05
    header = ["batch", "LM head matmul", "one max pass"] + [CASES[c][0] for c in cases]
    print(f"\nms per sampling step, median of {args.reps} (range)\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for batch in batches:
        hidden = torch.randn(batch, HIDDEN, generator=gen)
        logits = torch.randn(batch, args.vocab, generator=gen) * 4.0
        row = [str(batch),
               _cell(_time(lambda _, h=hidden: torch.nn.functional.linear(h, weight), logits,
                           args.reps)),
               _cell(_time(lambda x: x.max(dim=-1), logits, args.reps))]
        for case in cases:
            meta = _metadata([CASES[case][1](i) for i in range(batch)], args.vocab)
            row.append(_cell(_time(lambda x, m=meta: sampler.forward(x, m), logits, args.reps)))
        print("| " + " | ".join(row) + " |", flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
