"""`ringserve bench throughput` (scripts/bench_throughput.py): offline throughput and overhead.

Part 1, the fixed workload (32 prompts of uniform 16..256 random tokens, outputs of uniform
16..256 tokens, seed 0, greedy, ignore_eos) on the tiny Llama (hidden 256, 4 layers, 4 heads,
2 kv heads, intermediate 512, vocab 8000), in one run through:
  * `ringserve.LLM.generate` (engine core in its own process, async scheduling);
  * transformers `generate` on one left-padded batch (max_new_tokens = the longest output);
  * transformers continuous batching (a ContinuousBatchingManager with 512 blocks of 32
    tokens and 512 batch tokens, per-request max_new_tokens).
Throughput is the workload's output tokens (the sum of the per-request lengths) per second of
wall time, so the padded batch is not credited for tokens nobody asked for.

Part 2, engine overhead with a null model (steps return at once): the engine core in its own
process, N requests decoding; µs per step split into schedule, execute (the null model), update,
output serialization (core side) and the rest of the client-observed step (zmq + decode).

Prints the machine, versions, the command, markdown tables and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any

WORKLOAD_SEED = 0
NUM_PROMPTS = 32


def workload(seed: int = WORKLOAD_SEED) -> tuple[list[list[int]], list[int]]:
    """The fixed prompts (token ids) and output lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 8000) for _ in range(rng.randint(16, 256))]
               for _ in range(NUM_PROMPTS)]
    outputs = [rng.randint(16, 256) for _ in range(NUM_PROMPTS)]
    return prompts, outputs


def bench_model_dir() -> str:
    """The benchmark's tiny Llama (the demo shape with intermediate 512)."""
    from ringserve.gpu.testing import tiny_model

    return str(tiny_model("demo", intermediate_size=512))


def run_ringserve(model: str, prompts: list[list[int]], outs: list[int], reps: int) -> list[float]:
    """Seconds for LLM.generate over the workload, `reps` times (after a warm-up request)."""
    from ringserve import LLM, SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]
    times = []
    with LLM(model, device="cpu", kv_cache_memory=256 << 20) as llm:
        llm.generate([{"prompt_token_ids": prompts[0]}], params[0], use_tqdm=False)
        for _ in range(reps):
            llm.reset_prefix_cache()  # every repetition starts cold, like the baselines
            start = time.perf_counter()
            results = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)
            times.append(time.perf_counter() - start)
            if [len(r.outputs[0].token_ids) for r in results] != outs:
                raise RuntimeError("ringserve produced the wrong number of tokens")
    return times


def run_hf_batched(model: str, prompts: list[list[int]], outs: list[int], reps: int) -> list[float]:
    """Seconds for one left-padded transformers generate over the workload, `reps` times."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    pad = hf.generation_config.pad_token_id or 0
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    times = []
    with torch.no_grad():
        hf.generate(ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=4, do_sample=False)
        for _ in range(reps):
            start = time.perf_counter()
            hf.generate(ids, attention_mask=mask, max_new_tokens=max(outs), do_sample=False,
                        eos_token_id=None, pad_token_id=pad)
            times.append(time.perf_counter() - start)
    return times


def run_hf_continuous(model: str, prompts: list[list[int]], outs: list[int],
                      reps: int) -> list[float]:
    """Seconds for transformers continuous batching (512 blocks, page 32, 512 batch tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(outs), eos_token_id=None,
                           pad_token_id=hf.generation_config.pad_token_id)
    cb = ContinuousBatchingConfig(num_blocks=512, page_size=32, max_batch_tokens=512)
    times = []
    for _ in range(reps):
        with torch.no_grad(), hf.continuous_batching_context_manager(
                generation_config=gen, continuous_batching_config=cb, block=True,
                timeout=5) as mgr:
            start = time.perf_counter()
            ids = [mgr.add_request(p, max_new_tokens=n) for p, n in zip(prompts, outs, strict=True)]
            done = 0
            while done < len(ids):
                result = mgr.get_result(timeout=1)
                if result is not None and result.is_finished():
                    done += 1
                elif result is None and not mgr.is_running():
                    raise RuntimeError("transformers continuous batching stopped early")
            times.append(time.perf_counter() - start)
    return times


def run_null_overhead(model: str, num_running: int, executor: str,
                      steps: int = 400) -> dict[str, float]:
    """µs per decode step with the null model, split into phases (core in its own process).

    The core runs flat out (the client only drains outputs), so `step` is the core's
    sustained step time: elapsed wall time over steps taken.
    """
    from ringserve import EngineArgs, SamplingParams
    from ringserve.engine.mp_client import SyncMPClient
    from ringserve.engine.wire import EngineCoreRequest

    config = EngineArgs(model=model, device="cpu", max_num_seqs=max(num_running, 8),
                        num_gpu_blocks_override=num_running * 64 + 16, max_model_len=2048,
                        disable_log_stats=True).create_engine_config()
    client = SyncMPClient(config, executor=executor)
    try:
        params = SamplingParams(max_tokens=1500, ignore_eos=True)
        for i in range(num_running):
            client.add_request(EngineCoreRequest(f"r{i}", [7 + i % 900] * 16, params, time.time()))
        for _ in range(20):  # prefill and settle
            client.get_output()
        client.call_utility("get_step_timings")
        for _ in range(steps):
            client.get_output()
        core = client.call_utility("get_step_timings")
        client.abort_requests([f"r{i}" for i in range(num_running)])
    finally:
        client.shutdown()
    n = max(core["steps"], 1.0)
    result = {k: core.get(k, 0.0) / n * 1e6 for k in ("schedule", "execute", "update", "output")}
    result["step"] = core["elapsed"] / n * 1e6
    result["steps"] = n
    return result


def machine() -> dict[str, Any]:
    """Machine and versions for the report."""
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cores": os.cpu_count(),
            "kernel": platform.release(), "command": " ".join(sys.argv)}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints tables and a JSON line."""
    parser = argparse.ArgumentParser(prog="ringserve bench throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines")
    parser.add_argument("--overhead-only", action="store_true", help="only the null-model part")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per engine")
    ns = parser.parse_args(argv)
    model = bench_model_dir()
    prompts, outs = workload()
    total = sum(outs)
    report: dict[str, Any] = {"bench": "throughput", "machine": machine(), "output_tokens": total}
    print(json.dumps(report["machine"]))
    if not ns.overhead_only:
        runs = {"ringserve LLM.generate": run_ringserve}
        if not ns.skip_hf:
            runs["transformers generate (padded batch)"] = run_hf_batched
            runs["transformers continuous batching"] = run_hf_continuous
        times = {name: fn(model, prompts, outs, ns.reps) for name, fn in runs.items()}
        rates = {name: total / statistics.median(t) for name, t in times.items()}
        report["tok_per_s"] = rates
        report["seconds"] = times
        print(f"\n| engine | output tok/s (median of {ns.reps}) | runs (s) |\n|---|---:|---|")
        for name, rate in rates.items():
            runs_s = ", ".join(f"{t:.2f}" for t in times[name])
            print(f"| {name} | {rate:,.0f} | {runs_s} |")
        base = rates.get("transformers generate (padded batch)")
        if base:
            ratio = rates["ringserve LLM.generate"] / base
            report["ratio_vs_hf_batched"] = ratio
            print(f"\nringserve / transformers batched generate: {ratio:.2f}x (target >= 2x)")
    overhead = {f"{kind} {n}": run_null_overhead(model, n, kind)
                for kind in ("null", "null-mp") for n in (64, 256)}
    report["null_overhead_us"] = overhead
    print("\nNull model; core in its own process; `null`: model in the core process, `null-mp`: in "
          "an mp worker behind the rings (execute = ring round trip + null step).\n")
    print("| executor, running | schedule | execute | update | output ser. (thread) | step |")
    print("|---|---:|---:|---:|---:|---:|")
    for key, r in overhead.items():
        print(f"| {key} | {r['schedule']:.0f} | {r['execute']:.0f} | {r['update']:.0f} | "
              f"{r['output']:.0f} | {r['step']:.0f} |")
    print(json.dumps(report))
    return 0
