#!/usr/bin/env python3
"""Benchmark the engine core's scheduler (issue 4): µs per schedule() + update_from_output().

Measures, with fake one-token model outputs and the GC frozen after setup:
  * decode steps at 64, 256 and 1024 running requests (128-token prompts, block size 16),
    prefix caching off and on (0% hit rate: every prompt is distinct);
  * a burst of 256 new 512-token prompts with an 8192-token budget: intake (add_request) per
    request and schedule + update per step until every prompt is prefilled;
  * intake per 128-token request, prefix caching off and on;
  * the prefix hash candidates (sha256 vs blake2b-128) per 16-token block.
On/off runs are interleaved and repeated, so the on/off ratio is not skewed by machine drift.
Prints the machine, versions, the command, a pure-Python calibration loop (ns per dict insert,
to scale numbers between machines) and markdown tables for docs/benchmarks.md.

The vLLM column: with `--vllm`, when `vllm` imports, vLLM's own V1 scheduler is driven by the
same decode workload in the same run (same sizes, prompts, fake outputs and GC freeze; its
ModelConfig needs a model's config, `--vllm-model`, default facebook/opt-125m) and the target is
a third of what it measured here. Without vLLM (or without `--vllm`) the script prints one line
saying so, and the target is a third of the vLLM 0.33 figures quoted in issue 4, which were
measured in another run by the issue's author, not by this script.

Usage: .venv/bin/python scripts/bench_scheduler.py [--quick] [--vllm [--vllm-model M]]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import platform
import statistics
import sys
import time

import msgspec

from ringserve.config import CacheConfig, SchedulerConfig
from ringserve.engine.sched.scheduler import Scheduler
from ringserve.engine.wire import EngineCoreRequest
from ringserve.gpu.wire import ModelRunnerOutput, SchedulerOutput
from ringserve.sampling_params import SamplingParams

BLOCK = 16
TOKEN = 1234


def calibration_ns() -> float:
    """ns per iteration of a fixed dict-insert loop (best of 7)."""
    best = float("inf")
    for _ in range(7):
        d: dict[int, int] = {}
        t0 = time.perf_counter_ns()
        for i in range(100_000):
            d[i] = i
        best = min(best, (time.perf_counter_ns() - t0) / 100_000)
    return best


def make_requests(n: int, prompt_len: int, start: int) -> list[EngineCoreRequest]:
    sp = SamplingParams(max_tokens=None, ignore_eos=True)
    now = time.time()
    return [
        EngineCoreRequest(f"req-{start + i}", [(start + i) * 7919 % 50_000 + j for j in range(prompt_len)], sp, now)
        for i in range(n)
    ]


def make_scheduler(num_running: int, caching: bool, budget: int = 8192) -> Scheduler:
    max_model_len = 4096
    blocks = num_running * (max_model_len // BLOCK) + 16
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max(num_running, 1), max_num_batched_tokens=budget, max_model_len=max_model_len
        ),
        CacheConfig(block_size=BLOCK, enable_prefix_caching=caching),
        blocks,
        eos_token_ids=(2,),
        log_stats=True,
    )


def fake_output(so: SchedulerOutput, sched: Scheduler) -> ModelRunnerOutput:
    """One sampled token for every request whose scheduled tokens reach its end."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    requests = sched.requests
    for rid in req_ids:
        r = requests[rid]
        sampled.append([TOKEN] if r.num_computed_tokens >= r.num_tokens else [])
    return ModelRunnerOutput(so.step_id, req_ids, sampled)


def timed_step(sched: Scheduler) -> float:
    """µs for one schedule() + update_from_output() (building the fake output excluded)."""
    t0 = time.perf_counter_ns()
    so = sched.schedule()
    t1 = time.perf_counter_ns()
    mro = fake_output(so, sched)
    t2 = time.perf_counter_ns()
    sched.update_from_output(so, mro)
    t3 = time.perf_counter_ns()
    return ((t1 - t0) + (t3 - t2)) / 1000


def prefilled(num_running: int, caching: bool) -> Scheduler:
    """A scheduler whose `num_running` requests have all finished their prefill."""
    sched = make_scheduler(num_running, caching)
    for req in make_requests(num_running, 128, 0):
        sched.add_request(req)
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        timed_step(sched)
    for _ in range(5):
        timed_step(sched)
    return sched


def decode_pair(num_running: int, steps: int) -> dict[bool, list[float]]:
    """Step a caching-off and a caching-on scheduler alternately (so machine noise hits
    both alike); µs per schedule + update for each."""
    scheds = {False: prefilled(num_running, False), True: prefilled(num_running, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    gc.collect()
    gc.freeze()
    try:
        for i in range(steps):
            order = (False, True) if i % 2 == 0 else (True, False)
            for caching in order:
                times[caching].append(timed_step(scheds[caching]))
    finally:
        gc.unfreeze()
    return times


def burst_run(caching: bool) -> tuple[float, list[float]]:
    sched = make_scheduler(256, caching, budget=8192)
    reqs = make_requests(256, 512, 10_000)
    gc.collect()
    gc.freeze()
    try:
        t0 = time.perf_counter_ns()
        for req in reqs:
            sched.add_request(req)
        intake = (time.perf_counter_ns() - t0) / 1000 / len(reqs)
        steps = []
        while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
            steps.append(timed_step(sched))
        return intake, steps
    finally:
        gc.unfreeze()


def intake_pair(batches: int, batch: int = 32) -> dict[bool, list[float]]:
    """µs per add_request (128-token prompts), batches alternating caching off and on."""
    scheds = {False: make_scheduler(batches * batch, False), True: make_scheduler(batches * batch, True)}
    out: dict[bool, list[float]] = {False: [], True: []}
    gc.collect()
    gc.freeze()
    try:
        for i in range(batches):
            for caching in (False, True) if i % 2 == 0 else (True, False):
                reqs = make_requests(batch, 128, 100_000 + (2 * i + caching) * batch)
                t0 = time.perf_counter_ns()
                for req in reqs:
                    scheds[caching].add_request(req)
                out[caching].append((time.perf_counter_ns() - t0) / 1000 / batch)
    finally:
        gc.unfreeze()
    return out


def hash_candidates() -> dict[str, float]:
    toks = list(range(100_000, 100_512))
    enc = msgspec.msgpack.encode
    root = hashlib.sha256(b"x").digest()

    def sha() -> None:
        parent = root
        for i in range(0, 512, 16):
            parent = hashlib.sha256(parent + enc(toks[i : i + 16])).digest()

    def b2() -> None:
        parent = root[:16]
        for i in range(0, 512, 16):
            parent = hashlib.blake2b(parent + enc(toks[i : i + 16]), digest_size=16).digest()

    out: dict[str, float] = {}
    for _ in range(5):
        for name, fn in (("sha256", sha), ("blake2b-128", b2)):
            t0 = time.perf_counter_ns()
            for _ in range(500):
                fn()
            per_block = (time.perf_counter_ns() - t0) / 1000 / 500 / 32
            out[name] = min(out.get(name, float("inf")), per_block)
    return out


# vLLM 0.33's V1 scheduler, µs per schedule + update (median, prefix caching off / on), as
# quoted in issue 4: measured in another run by the author, not by this script.
VLLM_QUOTED = {64: (838.0, 853.0), 256: (3174.0, 3360.0), 1024: (13302.0, 14276.0)}


def vllm_available() -> str | None:
    """vLLM's version when it imports, else None."""
    try:
        import vllm
    except Exception:  # any import failure means "not usable here"
        return None
    return str(getattr(vllm, "__version__", "unknown"))


def _vllm_output(cls: type, so: object, sched: object) -> object:
    """vLLM's ModelRunnerOutput with one token for every request whose prefill is complete
    (fields passed by name, only those this vLLM version has)."""
    import dataclasses

    requests = sched.requests  # type: ignore[attr-defined]
    req_ids = list(so.num_scheduled_tokens)  # type: ignore[attr-defined]
    sampled = [[TOKEN] if requests[r].num_computed_tokens >= requests[r].num_tokens else []
               for r in req_ids]
    values = {"req_ids": req_ids, "req_id_to_index": {r: i for i, r in enumerate(req_ids)},
              "sampled_token_ids": sampled, "logprobs": None, "prompt_logprobs_dict": {},
              "pooler_output": []}
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(values)
    return cls(**{k: v for k, v in values.items() if k in names})


def vllm_decode(num_running: int, caching: bool, steps: int, model: str) -> list[float]:
    """µs per schedule() + update_from_output() of vLLM's V1 scheduler on the decode workload
    (`num_running` distinct 128-token prompts, block 16, fake one-token outputs, GC frozen);
    follows vLLM's own tests/v1/core/utils.py to build it."""
    import torch
    from vllm.config import CacheConfig as VCacheConfig
    from vllm.config import ModelConfig, VllmConfig
    from vllm.config import SchedulerConfig as VSchedulerConfig
    from vllm.sampling_params import SamplingParams as VSamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler as VScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput as VOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    try:
        from vllm.utils.hashing import get_hash_fn_by_name
    except ImportError:
        from vllm.utils import get_hash_fn_by_name  # type: ignore[attr-defined,no-redef]
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    max_model_len = 4096
    blocks = num_running * (max_model_len // BLOCK) + 16
    vconfig = VllmConfig(
        scheduler_config=VSchedulerConfig(max_num_seqs=max(num_running, 1), max_num_batched_tokens=8192,
                                          max_model_len=max_model_len, enable_chunked_prefill=True),
        model_config=ModelConfig(model=model, dtype="float16", seed=0, max_model_len=max_model_len),
        cache_config=VCacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                                  enable_prefix_caching=caching),
    )
    vconfig.cache_config.num_gpu_blocks = blocks
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(BLOCK, 1, 1, torch.float32, False))])
    sched = VScheduler(vllm_config=vconfig, kv_cache_config=kv, log_stats=True,
                       structured_output_manager=StructuredOutputManager(vconfig))
    hasher = get_request_block_hasher(BLOCK, hash_fn) if caching else None
    params = VSamplingParams(max_tokens=max_model_len - 256, ignore_eos=True)
    for req in make_requests(num_running, 128, 0):
        sched.add_request(Request(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                  sampling_params=params, pooling_params=None, eos_token_id=2,
                                  block_hasher=hasher))

    def step() -> float:
        t0 = time.perf_counter_ns()
        so = sched.schedule()
        t1 = time.perf_counter_ns()
        mro = _vllm_output(VOutput, so, sched)
        t2 = time.perf_counter_ns()
        sched.update_from_output(so, mro)
        return ((t1 - t0) + (time.perf_counter_ns() - t2)) / 1000

    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        step()
    for _ in range(5):
        step()
    gc.collect()
    gc.freeze()
    try:
        return [step() for _ in range(steps)]
    finally:
        gc.unfreeze()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--vllm", action="store_true",
                        help="also drive vLLM's V1 scheduler with the decode workload in this run "
                        "(skipped with a line when vllm does not import)")
    parser.add_argument("--vllm-model", default="facebook/opt-125m",
                        help="model (HF id or local dir) whose config vLLM's ModelConfig reads")
    args = parser.parse_args()
    steps = 200 if args.quick else 2000
    repeats = 2 if args.quick else 5

    print(f"command: {' '.join([sys.executable.split('/')[-1], *sys.argv])}")
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"machine: {platform.machine()} {cpu}; python {platform.python_version()}; msgspec {msgspec.__version__}")
    print(f"calibration: {calibration_ns():.1f} ns per dict insert (fixed pure-Python loop)")
    vllm_version = vllm_available() if args.vllm else None
    if vllm_version is None:
        why = "vllm does not import here" if args.vllm else "no --vllm flag"
        print(f"vLLM scheduler: skipped ({why}); the vLLM column is issue 4's quoted vLLM 0.33 "
              "figures, measured in another run by the issue's author, not in this run")
    else:
        print(f"vLLM scheduler: vllm {vllm_version}, driven with the same decode workload in this run "
              f"(config from {args.vllm_model})")
    print()

    source = "quoted from issue 4, another run" if vllm_version is None else f"vllm {vllm_version}, this run"
    print(f"| running decode requests | caching | median µs | p90 µs | µs / request | vLLM median µs ({source}) "
          "| target (1/3 of vLLM) |")
    print("|---|---|---|---|---|---|---|")
    ratios = {}
    for n in (64, 256, 1024):
        n_steps = max(steps * 64 // n, 60)
        times = decode_pair(n, n_steps)
        for caching in (False, True):
            med = statistics.median(times[caching])
            if vllm_version is None:
                theirs = VLLM_QUOTED[n][caching]
            else:
                theirs = statistics.median(vllm_decode(n, caching, n_steps, args.vllm_model))
            target = theirs / 3
            ok = "met" if med <= target else "missed"
            print(
                f"| {n} | {'on' if caching else 'off'} | {med:.0f} | {pct(times[caching], 0.9):.0f} | "
                f"{med / n:.2f} | {theirs:,.0f} | {target:.0f} ({ok}) |"
            )
        ratios[n] = statistics.median(times[True]) / statistics.median(times[False])
    print()
    print("| prefix caching on / off at 0% hits | " + " | ".join(f"{n} running" for n in ratios) + " |")
    print("|---|" + "---|" * len(ratios))
    print("| ratio of medians | " + " | ".join(f"{r:.3f}" for r in ratios.values()) + " |")
    print()

    print("| burst: 256 x 512-token prompts, budget 8192 | caching | intake µs / request | steps | median µs / step | p90 µs / step | total µs |")
    print("|---|---|---|---|---|---|---|")
    for caching in (False, True):
        intakes, step_times, totals = [], [], []
        for _ in range(repeats):
            intake, st = burst_run(caching)
            intakes.append(intake)
            step_times.extend(st)
            totals.append(intake * 256 + sum(st))
        print(
            f"| | {'on' if caching else 'off'} | {statistics.median(intakes):.1f} | {len(step_times) // repeats} | "
            f"{statistics.median(step_times):.0f} | {pct(step_times, 0.9):.0f} | {statistics.median(totals):.0f} |"
        )
    print()
    print("| intake, 128-token prompt | median µs / request | p90 | target |")
    print("|---|---|---|---|")
    per_request = intake_pair(40 if args.quick else 160)
    for caching in (False, True):
        value = statistics.median(per_request[caching])
        verdict = ("< 20 (met)" if value < 20 else "< 20 (missed)") if caching else "-"
        print(
            f"| prefix caching {'on' if caching else 'off'} | {value:.1f} | "
            f"{pct(per_request[caching], 0.9):.1f} | {verdict} |"
        )
    print()
    hashes = hash_candidates()
    print("| prefix hash (16-token block, msgpack-encoded) | µs / block |")
    print("|---|---|")
    for name, value in hashes.items():
        print(f"| {name} | {value:.3f} |")


if __name__ == "__main__":
    main()
