"""`ringserve bench throughput` (scripts/bench_throughput.py): offline throughput and overhead.

Part 1, the fixed workload (32 prompts of uniform 16..256 random tokens, outputs of uniform
16..256 tokens, seed 0, greedy, ignore_eos) on the tiny Llama (hidden 256, 4 layers, 4 heads,
2 kv heads, intermediate 512, vocab 8000), through:
  * `ringserve.LLM.generate` (engine core in its own process, async scheduling);
  * transformers `generate` on one left-padded batch (max_new_tokens = the longest output);
  * transformers continuous batching (a ContinuousBatchingManager with 512 blocks of 32
    tokens and 512 batch tokens, per-request max_new_tokens).
`--runs` rounds (default 3) run each engine once in turn (loaded, warmed up, timed and closed
alone, so no other engine is alive while one is timed), so a round's engines see about the
same machine load. Every run counts the tokens each engine
actually generated per request and checks them against the workload's lengths (a mismatch is
printed loudly); throughput is the tokens generated that were asked for (per request at most
its length: the padded batch is not credited for the tokens nobody asked for) per second of
wall time. The table gives the median of the rounds and the range; the ratio to transformers'
batched generate is taken within each round, and its median and range are printed.

Part 2, engine overhead with a null model (steps return at once): the engine core in its own
process, N requests decoding; µs per step split into schedule, execute (the null model), update,
output serialization (core side) and the rest of the client-observed step (zmq + decode).

Prints the machine, versions, the command, markdown tables and one JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

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


class Sample(NamedTuple):
    """One timed run of the workload: wall seconds and the tokens generated per request."""

    seconds: float
    generated: list[int]


Runner = Callable[[], Sample]


@contextlib.contextmanager
def ringserve_runner(model: str, prompts: list[list[int]], outs: list[int],
                     **engine: Any) -> Iterator[Runner]:
    """`LLM.generate` over the workload (after a warm-up request), prefix cache reset each run;
    `engine`: further `LLM` arguments (e.g. enforce_eager=True)."""
    from ringserve import LLM, SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]
    with LLM(model, device="cpu", kv_cache_memory=256 << 20, **engine) as llm:
        llm.generate([{"prompt_token_ids": prompts[0]}], params[0], use_tqdm=False)

        def run() -> Sample:
            llm.reset_prefix_cache()  # every repetition starts cold, like the baselines
            start = time.perf_counter()
            results = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)
            seconds = time.perf_counter() - start
            return Sample(seconds, [len(r.outputs[0].token_ids) for r in results])

        yield run


@contextlib.contextmanager
def hf_batched_runner(model: str, prompts: list[list[int]], outs: list[int]) -> Iterator[Runner]:
    """One left-padded transformers `generate` over the workload (max_new_tokens = longest).

    Without an EOS every row generates the longest output; the count per row is what the
    returned sequences hold past the prompt.
    """
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    pad = hf.generation_config.pad_token_id or 0
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        hf.generate(ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=4, do_sample=False)

    def run() -> Sample:
        with torch.no_grad():
            start = time.perf_counter()
            seqs = hf.generate(ids, attention_mask=mask, max_new_tokens=max(outs),
                               do_sample=False, eos_token_id=None, pad_token_id=pad)
            seconds = time.perf_counter() - start
        return Sample(seconds, [int(seqs.shape[1]) - longest] * len(prompts))

    yield run


@contextlib.contextmanager
def hf_continuous_runner(model: str, prompts: list[list[int]],
                         outs: list[int]) -> Iterator[Runner]:
    """transformers continuous batching (512 blocks, page 32, 512 batch tokens), one manager
    per run; the count per request is its result's `generated_tokens`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(outs), eos_token_id=None,
                           pad_token_id=hf.generation_config.pad_token_id)
    cb = ContinuousBatchingConfig(num_blocks=512, page_size=32, max_batch_tokens=512)

    def run() -> Sample:
        with torch.no_grad(), hf.continuous_batching_context_manager(
                generation_config=gen, continuous_batching_config=cb, block=True,
                timeout=5) as mgr:
            start = time.perf_counter()
            ids = [mgr.add_request(p, max_new_tokens=n) for p, n in zip(prompts, outs, strict=True)]
            got: dict[str, int] = {}
            while len(got) < len(ids):
                result = mgr.get_result(timeout=1)
                if result is not None and result.is_finished():
                    got[result.request_id] = len(result.generated_tokens)
                elif result is None and not mgr.is_running():
                    raise RuntimeError("transformers continuous batching stopped early")
            seconds = time.perf_counter() - start
        return Sample(seconds, [got[i] for i in ids])

    yield run


def check_counts(name: str, generated: list[int], outs: list[int],
                 at_least: bool = False) -> tuple[int, list[str]]:
    """Tokens to credit (per request at most what it asked for) and one line per mismatch.

    `at_least`: the engine is expected to generate more than asked (the padded batch), so
    only a shortfall is a mismatch.
    """
    pairs = list(zip(generated, outs, strict=False))
    problems = [f"request {i}: asked for {want}, {name} generated {got}"
                for i, (got, want) in enumerate(pairs)
                if got < want or (got > want and not at_least)]
    if len(generated) != len(outs):
        problems.append(f"{name} returned {len(generated)} results for {len(outs)} requests")
    return sum(min(got, want) for got, want in pairs), problems


def run_null_overhead(model: str, num_running: int, executor: str,
                      steps: int = 400) -> dict[str, float]:
    """µs per decode step with the null model, split into phases (core in its own process).

    The core runs flat out (the client only drains outputs), so `step` is the core's
    sustained step time: elapsed wall time over steps taken.
    """
    from ringserve import EngineArgs, SamplingParams
    from ringserve.engine.frontend.mp_client import SyncMPClient
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

    cpu = "?"
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    return {"cpu": cpu, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(),
            "kernel": platform.release(), "command": " ".join(sys.argv)}


RINGSERVE = "ringserve LLM.generate"
HF_BATCHED = "transformers generate (padded batch)"
HF_CB = "transformers continuous batching"


def _span(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def run_workload(model: str, runs: int, skip_hf: bool, report: dict[str, Any]) -> None:
    """Part 1: every engine once per round, `runs` rounds; prints the tables into stdout."""
    prompts, outs = workload()
    factories: dict[str, Callable[..., contextlib.AbstractContextManager[Runner]]] = {
        RINGSERVE: ringserve_runner}
    if not skip_hf:
        factories[HF_BATCHED] = hf_batched_runner
        factories[HF_CB] = hf_continuous_runner
    rates: dict[str, list[float]] = {name: [] for name in factories}
    seconds: dict[str, list[float]] = {name: [] for name in factories}
    generated: dict[str, list[int]] = {name: [] for name in factories}
    problems: list[str] = []
    for i in range(runs):
        for name, factory in factories.items():
            # Each engine is loaded, warmed up, run and closed alone: no other engine's
            # processes or threads are alive while one is timed.
            with factory(model, prompts, outs) as run:
                sample = run()
            credited, bad = check_counts(name, sample.generated, outs, at_least=name == HF_BATCHED)
            problems += [f"round {i + 1}: {line}" for line in bad]
            rates[name].append(credited / sample.seconds)
            seconds[name].append(sample.seconds)
            generated[name].append(sum(sample.generated))
    total = sum(outs)
    print(f"\noutput token check (the workload asks for {total:,} tokens in {len(outs)} requests):")
    for name in factories:
        print(f"  {name}: generated {', '.join(f'{g:,}' for g in generated[name])} per round"
              + (" (every row runs to the longest output; only the requested ones count)"
                 if name == HF_BATCHED else ""))
    if problems:
        print(f"!!! TOKEN COUNT MISMATCH ({len(problems)}): " + "; ".join(problems[:10]))
        print("!!! throughputs below count only the tokens actually generated")
    else:
        print("  every request of every engine got exactly the tokens it asked for")
    print(f"\n| engine | output tok/s (median of {runs}, range) | runs (s) |\n|---|---:|---|")
    for name in factories:
        runs_s = ", ".join(f"{t:.2f}" for t in seconds[name])
        print(f"| {name} | {_span(rates[name], ',.0f')} | {runs_s} |")
    report.update(tok_per_s={n: statistics.median(r) for n, r in rates.items()},
                  tok_per_s_runs=rates, seconds=seconds, generated_tokens=generated,
                  token_count_problems=problems)
    if HF_BATCHED in rates:
        ratios = [a / b for a, b in zip(rates[RINGSERVE], rates[HF_BATCHED], strict=True)]
        report["ratio_vs_hf_batched"] = statistics.median(ratios)
        report["ratio_vs_hf_batched_runs"] = ratios
        print(f"\nringserve / transformers batched generate, per round: "
              f"{', '.join(f'{r:.2f}' for r in ratios)}; median {_span(ratios, '.2f')}x "
              f"(target >= 2x)")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints tables and a JSON line."""
    parser = argparse.ArgumentParser(prog="ringserve bench throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines")
    parser.add_argument("--overhead-only", action="store_true", help="only the null-model part")
    parser.add_argument("--runs", "--reps", dest="runs", type=int, default=3,
                        help="rounds (every engine once per round); medians and ranges reported")
    ns = parser.parse_args(argv)
    if ns.runs < 1:
        parser.error("--runs must be >= 1")
    model = bench_model_dir()
    report: dict[str, Any] = {"bench": "throughput", "machine": machine(),
                              "output_tokens": sum(workload()[1])}
    print(json.dumps(report["machine"]))
    if not ns.overhead_only:
        run_workload(model, ns.runs, ns.skip_hf, report)
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
