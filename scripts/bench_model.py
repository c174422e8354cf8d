"""Forward throughput of ringserve's model runner vs transformers on the same model and batch.

Builds (or reuses) the demo model (Llama, hidden 256, 4 layers, float32), then times, on CPU,
one forward over a flat batch of `--seqs` prompts of `--len` tokens: ringserve's model on the
paged KV cache (torch reference attention, slot writes included, via the runner's input
preparation) against `AutoModelForCausalLM` on the same tokens as one [seqs, len] batch
(no padding needed: equal lengths). Both compute the final hidden states and the logits of
each sequence's last position only. Prints the machine, versions,
the command and the ratio (ringserve / transformers tokens per second; > 1 is faster):
`--runs` rounds (default 3) of `--iters` interleaved iterations each, the median of each
round's medians with the range, and the ratio per round.

    .venv/bin/python scripts/bench_model.py [--seqs 8] [--len 128] [--iters 9] [--runs 3]
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


def _bench(fns: list[Callable[[], None]], iters: int) -> list[float]:
    """Median seconds of each function, run interleaved so load from other processes on a
    shared machine hits both alike."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, samples in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from ringserve.engine.arg_utils import EngineArgs
    from ringserve.gpu.runner.input_prep import prepare_inputs
    from ringserve.gpu.runner.model_runner import ModelRunner
    from ringserve.gpu.testing import demo_model_path
    from ringserve.gpu.wire import NewRequestData
    from ringserve.sampling_params import SamplingParams

    model_dir = demo_model_path()
    block_size = 16
    blocks_per_seq = -(-args.len // block_size)
    config = EngineArgs(model=str(model_dir), device="cpu", block_size=block_size,
                        max_num_seqs=args.seqs, max_model_len=max(args.len, 256)).create_engine_config()
    runner = ModelRunner(config, torch.device("cpu"), attention_backend="torch")
    runner.load_model()
    runner.initialize_kv_cache(args.seqs * blocks_per_seq)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, config.model_config.vocab_size, (args.seqs, args.len), generator=gen)
    ids = [f"b{i}" for i in range(args.seqs)]
    for i, req_id in enumerate(ids):
        blocks = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        runner.table.apply_new(NewRequestData(req_id, tokens[i].tolist(), SamplingParams(), blocks, 0))
    num_sched = np.full(args.seqs, args.len, dtype=np.int32)

    def ours() -> None:
        with torch.inference_mode():
            inputs = prepare_inputs(runner.table, ids, num_sched, runner.device)
            hidden = runner.model.forward(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
            runner.model.compute_logits(hidden[inputs.logits_indices])

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def theirs() -> None:
        with torch.inference_mode():
            hf(tokens, use_cache=False, logits_to_keep=1)

    rounds = [_bench([ours, theirs], args.iters) for _ in range(max(args.runs, 1))]
    mine, hfs = [r[0] for r in rounds], [r[1] for r in rounds]
    ratios = [h / o for o, h in rounds]
    n = args.seqs * args.len
    import transformers

    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} "
          f"threads={args.threads}; python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}; load average {os.getloadavg()[0]:.2f}")
    print(f"command: {' '.join(sys.argv)}")
    print(f"model: demo (Llama, hidden 256, 4 layers, float32); batch {args.seqs} x {args.len} tokens")

    def span(values: list[float], scale: float = 1e3, digits: int = 1) -> str:
        med, lo, hi = (x * scale for x in (statistics.median(values), min(values), max(values)))
        return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"

    print(f"| engine | forward ms (median of {len(rounds)} rounds, range) | tokens/s (median) |")
    print("|---|---|---|")
    print(f"| ringserve runner (paged KV, torch attention) | {span(mine)} | {n / statistics.median(mine):,.0f} |")
    print(f"| transformers forward | {span(hfs)} | {n / statistics.median(hfs):,.0f} |")
    print(f"ratio ringserve / transformers per round: {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"median {span(ratios, 1.0, 2)}x")


if __name__ == "__main__":
    main()
