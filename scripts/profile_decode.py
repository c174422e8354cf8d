#!/usr/bin/env python3
"""Profile one decode step (issue 17): where its time goes at batch 1, 8 and 64, on the demo
model and on a SmolLM-135M-shaped Llama (`--load-format dummy`), eagerly and captured.

In process, on CPU with the default attention backend (the C decode kernel): a `ModelRunner`
is driven with hand-built SchedulerOutputs (no scheduler): B requests of `--prompt-len` random
tokens are prefilled (chunked under a token budget), then decode steps are timed. Each of the
`--runs` rounds times `--steps` steps after `--warmup` warm-up steps three times: captured (the
step total through the captured decode step, `ringserve.gpu.runner.decode_capture`: the fused C
step), plain (the eager step total, `execute_model` with the capture taken off the runner,
nothing wrapped) and instrumented (eager, with perf_counter wrappers installed by
this script on the instances, and on the runner module's helper names, restored afterwards;
nothing in src/ is changed). The breakdown comes from the instrumented run; its exclusive
categories (input prep, embedding, norms, qkv / o projections, rotary, KV write, attention,
MLP gate_up / down / activation, LM head, sampling metadata, sampler, output path) are
reported in ms per step and % of the instrumented step, and "other" (Python glue: residual
adds, reshapes, the diff, loops) is the step minus their sum. The plain minus instrumented
step total is the wrappers' own cost.

The engine step: the same workload through `LLM.generate` with the default settings (the
captured step; the real frontend, core process,
scheduler, executor and output processor), timed at max_tokens 1 and 1 + steps with
ignore_eos (the prompts are prefix-cached after a warm-up call); the difference per step,
minus the runner's captured step, is the engine loop + output path beyond the runner.

The bound: bytes read per decode step (all weights once, including the LM head, plus the KV
read by attention) over the read bandwidth measured in this run (`.sum()` of a 512 MB float32
tensor, median of 5, at the same thread count).

    .venv/bin/python scripts/profile_decode.py [--models demo,135m] [--batches 1,8,64]
        [--steps 20] [--warmup 3] [--runs 3] [--threads 2] [--no-engine]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BLOCK_SIZE = 16
PREFILL_BUDGET = 1024
SEED = 0
# SmolLM-135M's shape (Llama; float32 here); the tokenizer is the tiny model's (vocab 8000 of
# the 49152 rows, which changes nothing in the step's cost).
SMOL_135M: dict[str, Any] = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "tie_word_embeddings": True, "torch_dtype": "float32", "dtype": "float32",
    "max_position_embeddings": 2048, "rope_theta": 10000.0,
}
# Exclusive categories, in report order.
CATEGORIES = ("input prep", "embedding", "norms", "qkv_proj", "rotary", "KV write", "attention",
              "o_proj", "MLP gate_up", "MLP act (silu*up)", "MLP down", "LM head",
              "sampling metadata", "sampler", "output path (runner)")


# -- models ------------------------------------------------------------------------------------


def smol_135m_dir(root: Path) -> Path:
    """A SmolLM-135M-shaped model directory (config, generation config, tokenizer; no weights)
    under `root`, its tokenizer copied from the tiny Llama."""
    return shaped_model_dir(root, "smol-135m-shape", "llama", SMOL_135M)


def shaped_model_dir(root: Path, name: str, preset: str, shape: dict[str, Any]) -> Path:
    """`root/name`: the tiny `preset` model's directory (tokenizer, generation config) with
    `shape` over its config.json and no weights (`--load-format dummy`)."""
    from ringserve.gpu.testing import tiny_model

    src = tiny_model(preset)
    config = json.loads((src / "config.json").read_text())
    config.update(shape)
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            shutil.copy(item, out / item.name)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def engine_kwargs(model: str, tmp: Path, max_seqs: int, max_len: int) -> dict[str, Any]:
    """EngineArgs fields of a model key ("demo" or "135m")."""
    kw: dict[str, Any] = {"device": "cpu", "block_size": BLOCK_SIZE, "max_num_seqs": max_seqs,
                          "max_model_len": max_len, "disable_log_stats": True,
                          "cuda_graph_sizes": [max_seqs]}
    if model == "135m":
        kw.update(model=str(smol_135m_dir(tmp)), load_format="dummy")
    elif model != "demo":
        raise ValueError(f"--models: got {model!r}, allowed: demo, 135m")
    return kw


def build_runner(kw: dict[str, Any], num_blocks: int) -> Any:
    """A loaded ModelRunner with the default ("auto") attention backend."""
    import torch

    from ringserve.engine.arg_utils import EngineArgs
    from ringserve.gpu.runner.model_runner import ModelRunner

    config = EngineArgs(**kw).create_engine_config()
    runner = ModelRunner(config, torch.device("cpu"), attention_backend="auto")
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    return runner


def step_bytes(runner: Any, batch: int, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step reads: every linear, norm and the LM head once
    (a tied head reads the embedding matrix), plus each request's K and V over its context."""
    mc = runner.model_config
    hf, h, d = mc.hf_config, mc.hidden_size, mc.head_dim
    qkv = h * (mc.num_attention_heads + 2 * mc.num_kv_heads) * d
    layer = qkv + mc.num_attention_heads * d * h + 3 * h * hf["intermediate_size"] + 2 * h
    itemsize = runner.kv_caches[0].element_size()
    weights = (mc.num_hidden_layers * layer + h + mc.vocab_size * h + batch * h) * itemsize
    kv = batch * context * mc.num_hidden_layers * 2 * mc.num_kv_heads * d * itemsize
    return weights, kv


def read_bandwidth() -> float:
    """Bytes per second of a `.sum()` over 512 MB of float32 (far past any cache), median of 5."""
    import torch

    x = torch.ones(128 << 20, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times)


# -- driving the runner ------------------------------------------------------------------------


class Decoder:
    """B requests on one runner: prefilled under a token budget, then stepped one token each."""

    def __init__(self, runner: Any, batch: int, prompt_len: int, max_len: int) -> None:
        from ringserve.sampling_params import SamplingParams

        self.runner = runner
        rng = random.Random(SEED + batch)
        params = SamplingParams(temperature=0.0, max_tokens=max_len - prompt_len, ignore_eos=True)
        per_req = -(-max_len // BLOCK_SIZE)
        self.reqs = [(f"r{i}", [rng.randrange(100, 7900) for _ in range(prompt_len)],
                      list(range(1 + i * per_req, 1 + (i + 1) * per_req))) for i in range(batch)]
        self.params = params
        self.computed = {rid: 0 for rid, _, _ in self.reqs}
        self.step_id = 0

    def _run(self, new: list[Any], cached: list[Any], sched: dict[str, int]) -> float:
        """Run one step; returns the wall ms of `execute_model` alone."""
        from ringserve.gpu.wire import SchedulerOutput

        so = SchedulerOutput(self.step_id, new, cached, sched, sum(sched.values()), [])
        self.step_id += 1
        t0 = time.perf_counter()
        self.runner.execute_model(so)
        elapsed = 1e3 * (time.perf_counter() - t0)
        if self.runner.request_errors:
            raise RuntimeError(f"runner rejected requests: {self.runner.request_errors}")
        for rid, n in sched.items():
            self.computed[rid] += n
        return elapsed

    def prefill(self) -> None:
        """Schedule every prompt whole, as many per step as the budget allows."""
        from ringserve.gpu.wire import NewRequestData

        pending = list(self.reqs)
        while pending:
            new: list[Any] = []
            sched: dict[str, int] = {}
            used = 0
            while pending and (not new or used + len(pending[0][1]) <= PREFILL_BUDGET):
                rid, prompt, blocks = pending.pop(0)
                new.append(NewRequestData(rid, prompt, self.params, blocks, 0))
                sched[rid] = len(prompt)
                used += len(prompt)
            self._run(new, [], sched)

    def decode(self) -> float:
        """One decode step (every request computes the token it sampled last); returns the
        wall ms of `execute_model`."""
        from ringserve.gpu.wire import CachedRequestData

        cached = [CachedRequestData(rid, self.computed[rid]) for rid, _, _ in self.reqs]
        return self._run([], cached, {rid: 1 for rid, _, _ in self.reqs})

    def context(self) -> int:
        """The longest request's computed tokens."""
        return max(self.computed.values())

    def finish(self) -> None:
        """Drop every request from the runner (their slots and blocks serve the next batch)."""
        from ringserve.gpu.wire import SchedulerOutput

        self.runner.execute_model(SchedulerOutput(self.step_id, finished_req_ids=[
            rid for rid, _, _ in self.reqs]))
        self.step_id += 1


# -- instrumentation ---------------------------------------------------------------------------


@contextmanager
def instrumented(runner: Any, acc: dict[str, float]) -> Iterator[None]:
    """Accumulate inclusive seconds per key in `acc` by wrapping the runner's, model's and
    backend's instance methods (and the runner module's helpers); all restored on exit."""
    import ringserve.gpu.runner.model_runner as mr
    from ringserve.gpu.layers.norm import RMSNorm

    clock = time.perf_counter
    patched: list[tuple[Any, str, bool, Any]] = []

    def wrap(obj: Any, name: str, key: str) -> None:
        original = getattr(obj, name)
        own = name in vars(obj)
        patched.append((obj, name, own, vars(obj).get(name)))

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            out = original(*args, **kwargs)
            acc[key] = acc.get(key, 0.0) + clock() - t0
            return out
        setattr(obj, name, timed)

    model = runner.model
    wrap(runner, "execute_model", "step")
    wrap(runner, "_sample", "_sample")
    wrap(runner, "_apply_diff", "diff")
    wrap(runner.sampler, "forward", "sampler")
    wrap(runner.backend, "write_kv", "KV write")
    wrap(runner.backend, "attend", "attention")
    wrap(model, "compute_logits", "LM head")
    wrap(model.model.embed_tokens, "forward", "embedding")
    wrap(model.model.rotary, "rotate", "rotary")
    for module in model.modules():
        if isinstance(module, RMSNorm):
            wrap(module, "forward", "norms")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        wrap(attn.qkv_proj, "forward", "qkv_proj")
        wrap(attn.o_proj, "forward", "o_proj")
        wrap(mlp, "forward", "_mlp")
        wrap(mlp.gate_up_proj, "forward", "MLP gate_up")
        wrap(mlp.down_proj, "forward", "MLP down")
    for name, key in (("prepare_inputs", "input prep"), ("build_sampling_metadata",
                      "sampling metadata"), ("compute_prompt_logprobs", "prompt logprobs")):
        wrap(mr, name, key)
    try:
        yield
    finally:
        for obj, name, own, value in reversed(patched):
            if own:  # the module's helpers
                setattr(obj, name, value)
            else:  # instance attributes shadowing the class's methods
                delattr(obj, name)


def exclusive(acc: dict[str, float], steps: int) -> dict[str, float]:
    """Inclusive seconds (from `instrumented`) -> exclusive ms per step per CATEGORY, plus
    "step" and "other" (the step minus the categories' sum)."""
    ms = {k: 1e3 * v / steps for k, v in acc.items()}
    out = {c: ms.get(c, 0.0) for c in CATEGORIES}
    out["MLP act (silu*up)"] = ms.get("_mlp", 0.0) - out["MLP gate_up"] - out["MLP down"]
    out["output path (runner)"] = (ms.get("_sample", 0.0) - out["LM head"]
                                   - out["sampling metadata"] - out["sampler"])
    out["step"] = ms.get("step", 0.0)
    out["other"] = out["step"] - sum(out[c] for c in CATEGORIES)
    return out


# -- measuring ---------------------------------------------------------------------------------


def timed_steps(dec: Decoder, n: int) -> list[float]:
    """Wall ms of each of `n` decode steps (`execute_model` only)."""
    return [dec.decode() for _ in range(n)]


def profile_batch(runner: Any, batch: int, args: argparse.Namespace, max_len: int,
                  log: Callable[[str], None]) -> dict[str, Any]:
    """Prefill `batch` requests, then `args.runs` rounds of plain and instrumented steps."""
    dec = Decoder(runner, batch, args.prompt_len, max_len)
    t0 = time.perf_counter()
    dec.prefill()
    log(f"  batch {batch}: prefill {time.perf_counter() - t0:.1f} s")
    context0 = dec.context()
    plain, captured, breakdowns, instr_steps = [], [], [], []
    capture = runner.capture
    if capture is None:
        log(f"  no captured step: {runner.capture_reason}")
    for _ in range(args.runs):
        if capture is not None:
            timed_steps(dec, args.warmup)
            captured.append(statistics.median(timed_steps(dec, args.steps)))
        runner.capture = None
        timed_steps(dec, args.warmup)
        plain.append(statistics.median(timed_steps(dec, args.steps)))
        acc: dict[str, float] = {}
        with instrumented(runner, acc):
            timed_steps(dec, args.warmup)
            acc.clear()
            instr_steps.append(statistics.median(timed_steps(dec, args.steps)))
        breakdowns.append(exclusive(acc, args.steps))
        runner.capture = capture
    weights, kv = step_bytes(runner, batch, (context0 + dec.context()) // 2)
    dec.finish()
    log(f"  batch {batch}: eager step {statistics.median(plain):.2f} ms, captured "
        f"{statistics.median(captured) if captured else float('nan'):.2f} ms")
    return {"batch": batch, "plain_ms": plain, "captured_ms": captured,
            "instrumented_ms": instr_steps,
            "breakdown": {k: statistics.median(b[k] for b in breakdowns) for k in breakdowns[0]},
            "weight_bytes": weights, "kv_bytes": kv, "context": (context0, dec.context())}


def engine_steps(kw: dict[str, Any], batches: list[int], args: argparse.Namespace,
                 log: Callable[[str], None]) -> dict[int, list[float]]:
    """ms per decode step through `LLM.generate` (see the module docstring), per batch."""
    from ringserve import LLM
    from ringserve.sampling_params import SamplingParams

    llm = LLM(**kw)
    out: dict[int, list[float]] = {}
    try:
        for batch in batches:
            rng = random.Random(SEED + batch)
            prompts: list[Any] = [{"prompt_token_ids": [rng.randrange(100, 7900)
                                                        for _ in range(args.prompt_len)]}
                                  for _ in range(batch)]

            def run(n: int, prompts: list[Any] = prompts) -> float:
                params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                return time.perf_counter() - t0

            run(1 + args.warmup)  # warm-up; caches the prompts' prefixes
            per_step = []
            for _ in range(args.runs):
                short, long = run(1), run(1 + args.steps)
                per_step.append(1e3 * (long - short) / args.steps)
            out[batch] = per_step
            log(f"  engine batch {batch}: {statistics.median(per_step):.2f} ms / step")
    finally:
        llm.close()
    return out


# -- reporting ---------------------------------------------------------------------------------


def span(values: list[float], fmt: str = ".2f") -> str:
    """'median (min-max)'."""
    return (f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})")


def report(model: str, results: list[dict[str, Any]], engine: dict[int, list[float]] | None,
           bandwidth: float) -> str:
    """Markdown tables for one model: step totals and bound, then the breakdown."""
    lines = [f"### {model}", "", "| batch | captured step ms | eager step ms, plain | "
             "instrumented ms | engine step ms (LLM.generate) | engine - captured ms | weights + "
             "KV read MB | bound ms | bound / captured | bound / eager |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        plain = statistics.median(r["plain_ms"])
        cap = statistics.median(r["captured_ms"]) if r["captured_ms"] else None
        eng = engine.get(r["batch"]) if engine else None
        eng_text = span(eng) if eng else "not run"
        diff = f"{statistics.median(eng) - cap:.2f}" if eng and cap else "-"
        mb = (r["weight_bytes"] + r["kv_bytes"]) / 1e6
        bound = 1e3 * (r["weight_bytes"] + r["kv_bytes"]) / bandwidth
        cap_text = span(r["captured_ms"]) if cap else "not captured"
        cap_ratio = f"{100 * bound / cap:.0f}%" if cap else "-"
        lines.append(f"| {r['batch']} | {cap_text} | {span(r['plain_ms'])} | "
                     f"{span(r['instrumented_ms'])} | {eng_text} | {diff} | {mb:.1f} "
                     f"({r['kv_bytes'] / 1e6:.1f} KV) | {bound:.2f} | {cap_ratio} | "
                     f"{100 * bound / plain:.0f}% |")
    head = " | ".join(f"batch {r['batch']} ms (%)" for r in results)
    lines += ["", f"| category (eager, instrumented; mean ms per step, median of rounds) | {head} |",
              "|---|" + "---|" * len(results)]
    for cat in (*CATEGORIES, "other"):
        cells = []
        for r in results:
            b = r["breakdown"]
            cells.append(f"{b[cat]:.3f} ({100 * b[cat] / b['step']:.1f}%)")
        lines.append(f"| {cat} | {' | '.join(cells)} |")
    cells = [f"{r['breakdown']['step']:.3f}" for r in results]
    lines.append(f"| **step (instrumented)** | {' | '.join(cells)} |")
    return "\n".join(lines)


def header(args: argparse.Namespace, bandwidth: float) -> list[str]:
    """Command, machine, versions and the measured bandwidth."""
    import torch

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return [
        f"command: {' '.join([sys.executable.split('/')[-1], *sys.argv])}",
        f"machine: {platform.machine()} {cpu}, cpus={os.cpu_count()}, load average "
        f"{os.getloadavg()[0]:.2f}; python {platform.python_version()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)",
        f"read bandwidth (.sum() over 512 MB float32, median of 5): {bandwidth / 1e9:.2f} GB/s",
        f"workload: B requests of {args.prompt_len} random prompt tokens prefilled, then "
        f"{args.runs} rounds of {args.warmup} warm-up + {args.steps} timed decode steps "
        "(median per step), greedy; attention backend auto",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default="demo,135m", help="comma-separated: demo, 135m")
    parser.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3, help="rounds")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--no-engine", action="store_true", help="skip the LLM.generate timing")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # the engine's core process
    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.prompt_len + 1 + args.runs * 3 * (args.warmup + args.steps) + 16
    bandwidth = read_bandwidth()
    for line in header(args, bandwidth):
        print(line)
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        for model in [m.strip() for m in args.models.split(",") if m.strip()]:
            kw = engine_kwargs(model, Path(tmp), max(batches), max_len)
            log(f"{model}:")
            runner = build_runner(kw, 1 + max(batches) * -(-max_len // BLOCK_SIZE))
            results = [profile_batch(runner, b, args, max_len, log) for b in batches]
            del runner
            engine = None if args.no_engine else engine_steps(kw, batches, args, log)
            name = ("demo model (Llama, hidden 256, 4 layers, vocab 8000)" if model == "demo"
                    else "SmolLM-135M shape (Llama, hidden 576, 30 layers, vocab 49152, tied, "
                         "dummy weights)")
            print()
            print(report(f"{name}, float32", results, engine, bandwidth))
            # 2 threads on 2 cores: any other busy process stalls every parallel region.
            print(f"\nload average after this model: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
