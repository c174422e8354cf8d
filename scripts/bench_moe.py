#!/usr/bin/env python3
"""Mixture of experts on CPU: one MoE layer per token, and offline throughput of a tiny MoE
model, each against transformers in the same run.

Part 1, the layer. One sparse MoE block (router + top-k + SwiGLU experts, float32) at two
shapes, `--shapes`: "mixtral" (Mixtral-like: 8 experts, top-2, hidden 1024, expert
intermediate 1536) and "qwen3" (Qwen3-MoE-like: 64 experts, top-8, hidden 768, expert
intermediate 256, top-k probabilities renormalised); 151 MB of expert weights each. Every path
gets the same weights (random, scaled so outputs are of order 1, seed 0) and the same input
[T, H] (T = `--tokens`, default 1, 16, 256), and every timed call is the whole block: the
router projection, the float32 softmax / top-k / renormalisation, the experts and the
weighted sum.
  * ringserve: `ringserve.gpu.models.moe.SparseMoeBlock`, what the engine runs (its
    `FusedMoE` with the weights packed for the C kernel, `ringserve.gpu.moe.cpu_experts`);
  * torch grouped: `router.select_experts` + `grouped.fused_experts` (`torch._grouped_mm`);
  * per-expert loop: `router.select_experts` + `grouped.per_expert_loop`;
  * transformers: the family's own block (`MixtralSparseMoeBlock` / `Qwen3MoeSparseMoeBlock`)
    holding the same tensors, with `experts_implementation="grouped_mm"` (what
    `from_pretrained` picks by default here) and "eager" (its loop over the experts hit).
Each path's output is compared with transformers' eager block (max abs difference). Timing:
`--rounds` interleaved rounds (every path once per round, the order rotating); a sample is
enough back-to-back calls to last >= 50 ms, its mean per call; the table gives µs per token
(the median over rounds, and the range) and the speedup over transformers' default block,
taken within each round (its median).

Part 2, offline throughput. A tiny Qwen3-MoE (`ringserve.gpu.testing.cached_model`: hidden 256,
4 layers, all sparse, 16 experts, top-2, expert intermediate 256, so the active MLP matches
the dense benchmark model's 512; 4 heads, 2 KV heads, vocab 8000, float32) on a fixed workload:
32 prompts of uniform 64..128 random tokens (seed 0), 128 output tokens each, greedy, EOS
ignored, so every engine must generate exactly 4,096 tokens. ringserve `LLM.generate` against
transformers `generate` on one left-padded batch, with `ringserve bench throughput`'s runners
and token-count check (`ringserve.bench.throughput`): `--runs` rounds, each engine
loaded, warmed up, timed and closed alone; tok/s median and range, the ratio taken per round.
Target (the issue): >= 2x transformers. `--workloads fixed,dense` adds `ringserve bench
throughput`'s workload (outputs of 16..256 tokens; the padded batch is credited only the tokens
asked for),
the one the dense models' 2x was measured on; `--offline-models moe,dense` adds that benchmark's
dense tiny Llama (hidden 256, 4 layers, intermediate 512) as a control, through the captured
decode step that MoE models do not get (`ringserve.gpu.runner.decode_capture`).

Prints the machine, versions, the command, markdown tables and a JSON line.

    .venv/bin/python scripts/bench_moe.py [--threads 2] [--shapes mixtral,qwen3]
        [--tokens 1,16,256] [--rounds 7] [--runs 3] [--workloads fixed,dense]
        [--offline-models moe,dense] [--skip-layer] [--skip-offline]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MIN_SAMPLE_S = 0.05
NUM_PROMPTS, PROMPT_LENS, OUTPUT_LEN = 32, (64, 128), 128


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer's shape; `family` picks transformers' block (both renormalise the top-k)."""

    label: str
    family: str  # "mixtral" or "qwen3_moe"
    experts: int
    top_k: int
    hidden: int
    inter: int

    @property
    def weight_mb(self) -> float:
        """Float32 expert weights (w13 + w2) in MB."""
        return self.experts * 3 * self.hidden * self.inter * 4 / 1e6


SHAPES = {
    "mixtral": LayerShape("Mixtral-like", "mixtral", experts=8, top_k=2, hidden=1024, inter=1536),
    "qwen3": LayerShape("Qwen3-MoE-like", "qwen3_moe", experts=64, top_k=8, hidden=768, inter=256),
}

RINGSERVE = "ringserve SparseMoeBlock (C kernel)"
GROUPED = "grouped.fused_experts (torch._grouped_mm)"
LOOP = "grouped.per_expert_loop"
HF_GROUPED = "transformers block, grouped_mm (default)"
HF_EAGER = "transformers block, eager"

Block = Callable[[Any], Any]  # x [T, H] -> [T, H]


def span(values: list[float], fmt: str = ".1f") -> str:
    """'median (min-max)'."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


# -- part 1: the layer ----------------------------------------------------------------------


def layer_weights(shape: LayerShape) -> tuple[Any, Any, Any]:
    """(router [E, H], w13 [E, 2I, H], w2 [E, H, I]), random, outputs of order 1."""
    import torch

    gen = torch.Generator().manual_seed(0)
    e, h, i = shape.experts, shape.hidden, shape.inter
    return (torch.randn(e, h, generator=gen) / h**0.5,
            torch.randn(e, 2 * i, h, generator=gen) / h**0.5,
            torch.randn(e, h, i, generator=gen) / i**0.5)


def ringserve_block(shape: LayerShape, gate: Any, w13: Any, w2: Any) -> Any:
    """The engine's `SparseMoeBlock` (TP 1) holding these weights, packed for the C kernel."""
    import torch

    from ringserve.gpu.layers.parallel import TPGroup
    from ringserve.gpu.models.moe import MoeSpec, SparseMoeBlock

    spec = MoeSpec(vocab_size=1, hidden_size=shape.hidden, intermediate_size=shape.inter,
                   num_layers=1, num_heads=1, num_kv_heads=1, head_dim=shape.hidden,
                   rms_norm_eps=1e-6, max_position=1, rope={}, qkv_bias=False, qk_norm=False,
                   mlp_bias=False, tie_word_embeddings=False, dtype=torch.float32,
                   num_experts=shape.experts, top_k=shape.top_k,
                   moe_intermediate_size=shape.inter, renormalize=True)
    block = SparseMoeBlock(spec, TPGroup())
    block.gate.weight.data.copy_(gate)
    block.experts.w13.data.copy_(w13)
    block.experts.w2.data.copy_(w2)
    block.experts.process_weights_after_loading()
    return block


def hf_block(shape: LayerShape, impl: str, gate: Any, w13: Any, w2: Any) -> Any:
    """transformers' block of the family, sharing these tensors, with experts `impl`."""
    import torch
    from torch import nn

    if shape.family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config: Any = MixtralConfig(hidden_size=shape.hidden, intermediate_size=shape.inter,
                                    num_local_experts=shape.experts,
                                    num_experts_per_tok=shape.top_k)
        cls: Any = MixtralSparseMoeBlock
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = Qwen3MoeConfig(hidden_size=shape.hidden, moe_intermediate_size=shape.inter,
                                num_experts=shape.experts, num_experts_per_tok=shape.top_k,
                                norm_topk_prob=True)
        cls = Qwen3MoeSparseMoeBlock
    config._experts_implementation = impl  # read by the experts at every forward
    with torch.device("meta"):
        block = cls(config)
    block.gate.weight = nn.Parameter(gate, requires_grad=False)
    block.experts.gate_up_proj = nn.Parameter(w13, requires_grad=False)
    block.experts.down_proj = nn.Parameter(w2, requires_grad=False)
    return block.eval()


def layer_paths(shape: LayerShape) -> tuple[dict[str, Block], bool]:
    """The five blocks on one set of weights; and whether ringserve's uses the C kernel."""
    import torch.nn.functional as F

    from ringserve.gpu.moe import grouped
    from ringserve.gpu.moe.router import select_experts

    gate, w13, w2 = layer_weights(shape)
    ours = ringserve_block(shape, gate, w13, w2)
    hf_grouped = hf_block(shape, "grouped_mm", gate, w13, w2)
    hf_eager = hf_block(shape, "eager", gate, w13, w2)

    def torch_path(experts: Callable[..., Any]) -> Block:
        def run(x: Any) -> Any:
            weights, ids = select_experts(F.linear(x, gate), shape.top_k, True, x.dtype)
            return experts(x, w13, w2, weights, ids)
        return run

    paths: dict[str, Block] = {
        RINGSERVE: ours.forward,
        GROUPED: torch_path(grouped.fused_experts),
        LOOP: torch_path(grouped.per_expert_loop),
        HF_GROUPED: lambda x: hf_grouped(x.unsqueeze(0)).squeeze(0),
        HF_EAGER: lambda x: hf_eager(x.unsqueeze(0)).squeeze(0),
    }
    return paths, ours.experts.packed is not None


def time_paths(paths: dict[str, Block], x: Any, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each path, one sample per round, the order rotating."""
    reps: dict[str, int] = {}
    for name, run in paths.items():
        run(x)
        start = time.perf_counter()
        run(x)
        reps[name] = max(1, math.ceil(MIN_SAMPLE_S / (time.perf_counter() - start)))
    names = list(paths)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            run, n = paths[name], reps[name]
            start = time.perf_counter()
            for _ in range(n):
                run(x)
            samples[name].append((time.perf_counter() - start) / n)
    return samples


def bench_layer(shape: LayerShape, tokens: list[int], rounds: int) -> dict[str, Any]:
    """Part 1 for one shape: prints the diffs and the table, returns the samples."""
    import torch

    with torch.inference_mode():
        paths, c_kernel = layer_paths(shape)
        print(f"\n### {shape.label}: {shape.experts} experts, top-{shape.top_k}, hidden "
              f"{shape.hidden}, expert intermediate {shape.inter}, float32 "
              f"({shape.weight_mb:.0f} MB of expert weights); load average "
              f"{os.getloadavg()[0]:.2f} at the start")
        if not c_kernel:
            print("!!! the C kernel is unavailable here: ringserve's block runs torch's grouped "
                  "GEMM")
        result: dict[str, Any] = {"shape": shape.label, "c_kernel": c_kernel, "tokens": {}}
        gen = torch.Generator().manual_seed(1)
        for t in tokens:
            x = torch.randn(t, shape.hidden, generator=gen)
            want = paths[HF_EAGER](x)
            diffs = {name: float((run(x) - want).abs().max()) for name, run in paths.items()
                     if name != HF_EAGER}
            scale = float(want.abs().max())
            print(f"T={t}: max |out - transformers eager| (outputs ~{scale:.1f}): "
                  + ", ".join(f"{name} {d:.1e}" for name, d in diffs.items()))
            result["tokens"][t] = {"seconds": time_paths(paths, x, rounds), "max_abs_diff": diffs}
    print_layer_table(result, tokens, rounds)
    return result


def print_layer_table(result: dict[str, Any], tokens: list[int], rounds: int) -> None:
    """µs per token and speedup over transformers' default block, per path and T."""
    names = list(result["tokens"][tokens[0]]["seconds"])
    head = " | ".join(f"T={t} µs/token | x vs HF" for t in tokens)
    print(f"\nµs per token, median of {rounds} interleaved rounds (range); x vs HF = transformers "
          f"grouped_mm block time / this path's, median of the per-round ratios\n")
    print(f"| path | {head} |\n|---|" + "---:|---:|" * len(tokens))
    for name in names:
        cells = []
        for t in tokens:
            seconds = result["tokens"][t]["seconds"]
            per_token = [s / t * 1e6 for s in seconds[name]]
            ratios = [b / a for a, b in zip(seconds[name], seconds[HF_GROUPED], strict=True)]
            cells.append(f"{span(per_token)} | {statistics.median(ratios):.2f}")
        print(f"| {name} | {' | '.join(cells)} |")


# -- part 2: offline throughput -------------------------------------------------------------


def moe_model_dir() -> str:
    """The benchmark's tiny Qwen3-MoE, built once into the model cache."""
    from ringserve.gpu.testing import TinyModelSpec, cached_model

    spec = TinyModelSpec(
        arch="qwen3_moe", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, initializer_range=0.05,
        extra_config=('{"num_experts": 16, "num_experts_per_tok": 2, '
                      '"moe_intermediate_size": 256, "norm_topk_prob": true}'))
    return str(cached_model(spec, name="bench-moe"))


def workload(name: str) -> tuple[list[list[int]], list[int]]:
    """The prompts (token ids) and output lengths of workload `name`.

    "fixed": NUM_PROMPTS prompts of uniform PROMPT_LENS random tokens, OUTPUT_LEN tokens each
    (the padded batch computes nothing past what was asked); "dense": `ringserve bench
    throughput`'s (outputs of uniform 16..256 tokens).
    """
    if name == "dense":
        from ringserve.bench.throughput import workload as dense_workload

        return dense_workload()
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 8000) for _ in range(rng.randint(*PROMPT_LENS))]
               for _ in range(NUM_PROMPTS)]
    return prompts, [OUTPUT_LEN] * NUM_PROMPTS


def hf_experts_implementation(model: str) -> str:
    """What transformers' `from_pretrained` picks for the model's experts here ("-": none)."""
    from transformers import AutoModelForCausalLM

    return str(AutoModelForCausalLM.from_pretrained(model).config._experts_implementation
               or "-")


def bench_eager_ab(runs: int) -> dict[str, Any]:
    """The MoE model on the fixed workload, ringserve with its captured decode step against
    `--enforce-eager` (every step eager), alternated once per round in the same run."""
    from ringserve.bench.throughput import check_counts, ringserve_runner

    model = moe_model_dir()
    prompts, outs = workload("fixed")
    names = {"captured decode step": {}, "--enforce-eager": {"enforce_eager": True}}
    rates: dict[str, list[float]] = {name: [] for name in names}
    problems: list[str] = []
    for i in range(runs):
        for name, engine in names.items():
            with ringserve_runner(model, prompts, outs, **engine) as run:
                sample = run()
            credited, bad = check_counts(name, sample.generated, outs)
            problems += [f"round {i + 1}: {line}" for line in bad]
            rates[name].append(credited / sample.seconds)
    ratios = [a / b for a, b in zip(*rates.values(), strict=True)]
    print(f"\n### MoE decode: captured step vs --enforce-eager, fixed workload "
          f"({sum(outs):,} output tokens)")
    if problems:
        print(f"!!! TOKEN COUNT MISMATCH ({len(problems)}): " + "; ".join(problems[:10]))
    print(f"\n| ringserve | output tok/s (median of {runs}, range) |\n|---|---:|")
    for name in names:
        print(f"| {name} | {span(rates[name], ',.0f')} |")
    print(f"\ncaptured / eager per round: {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"median {span(ratios, '.2f')}x")
    return {"tok_per_s": rates, "ratio_runs": ratios, "token_count_problems": problems}


def bench_offline(model_name: str, workload_name: str, runs: int) -> dict[str, Any]:
    """Part 2: ringserve and transformers once per round; prints the check and the table."""
    from ringserve.bench.throughput import (
        bench_model_dir,
        check_counts,
        hf_batched_runner,
        ringserve_runner,
    )

    model = moe_model_dir() if model_name == "moe" else bench_model_dir()
    prompts, outs = workload(workload_name)
    impl = hf_experts_implementation(model) if model_name == "moe" else "-"
    hf_name = "transformers generate (padded batch" + (f", experts {impl})" if impl != "-" else ")")
    names = {"ringserve LLM.generate": ringserve_runner, hf_name: hf_batched_runner}
    rates: dict[str, list[float]] = {name: [] for name in names}
    generated: dict[str, list[int]] = {name: [] for name in names}
    problems: list[str] = []
    loads: list[float] = []
    for i in range(runs):
        loads.append(os.getloadavg()[0])
        for name, factory in names.items():
            with factory(model, prompts, outs) as run:
                sample = run()
            # the padded batch runs every row to the longest output: only a shortfall is wrong
            credited, bad = check_counts(name, sample.generated, outs, at_least=name == hf_name)
            problems += [f"round {i + 1}: {line}" for line in bad]
            rates[name].append(credited / sample.seconds)
            generated[name].append(sum(sample.generated))
    ours, hf = (rates[name] for name in names)
    ratios = [a / b for a, b in zip(ours, hf, strict=True)]
    print(f"\n### Offline: {model_name} model ({model}), {workload_name} workload\n"
          f"{len(prompts)} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
          f"{min(outs)}..{max(outs)} output tokens each ({sum(outs):,} asked for), greedy, "
          "ignore_eos")
    for name in names:
        print(f"  {name}: generated {', '.join(f'{g:,}' for g in generated[name])} per round")
    if problems:
        print(f"!!! TOKEN COUNT MISMATCH ({len(problems)}): " + "; ".join(problems[:10]))
    else:
        print("  every request of every engine got at least the tokens it asked for (ringserve "
              "exactly; throughput credits only the tokens asked for)")
    print(f"\n| engine | output tok/s (median of {runs}, range) |\n|---|---:|")
    for name in names:
        print(f"| {name} | {span(rates[name], ',.0f')} |")
    met = "met" if statistics.median(ratios) >= 2 else "missed"
    print(f"\nringserve / transformers per round (1-min load average at its start): "
          f"{', '.join(f'{r:.2f} ({load:.2f})' for r, load in zip(ratios, loads, strict=True))}; "
          f"median {span(ratios, '.2f')}x (target >= 2x: {met})")
    return {"model": model_name, "model_dir": model, "workload": workload_name,
            "hf_experts_implementation": impl, "tok_per_s": rates, "generated": generated,
            "ratio_runs": ratios, "load_at_round_start": loads, "token_count_problems": problems}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch threads, every engine")
    p.add_argument("--shapes", default="mixtral,qwen3", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--tokens", default="1,16,256", help="tokens per layer call")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds, layer part")
    p.add_argument("--runs", type=int, default=3, help="rounds of the offline part")
    p.add_argument("--skip-layer", action="store_true")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--eager-ab", action="store_true",
                   help="also: the captured decode step against --enforce-eager (MoE model)")
    p.add_argument("--workloads", default="fixed",
                   help="offline workloads: fixed (equal outputs), dense (bench throughput's)")
    p.add_argument("--offline-models", default="moe",
                   help="offline models: moe, dense (the dense benchmark's tiny Llama: a control)")
    ns = p.parse_args()
    shapes = ns.shapes.split(",")
    workloads, models = ns.workloads.split(","), ns.offline_models.split(",")
    tokens = [int(t) for t in ns.tokens.split(",")]
    if (ns.threads < 1 or ns.rounds < 1 or ns.runs < 1 or min(tokens) < 1
            or not set(shapes) <= set(SHAPES) or not set(workloads) <= {"fixed", "dense"}
            or not set(models) <= {"moe", "dense"}):
        p.error(f"--threads, --rounds, --runs and --tokens must be >= 1; shapes of "
                f"{list(SHAPES)}, workloads of fixed, dense, offline models of moe, dense")
    os.environ["OMP_NUM_THREADS"] = str(ns.threads)  # before torch: the engine core's too
    import torch
    from transformers.utils import logging as hf_logging

    from ringserve.bench.throughput import machine

    torch.set_num_threads(ns.threads)
    hf_logging.disable_progress_bar()
    info = {**machine(), "command": shlex.join(sys.argv)}
    print(json.dumps(info), flush=True)
    report: dict[str, Any] = {"bench": "moe", "machine": info}
    if not ns.skip_layer:
        report["layer"] = [bench_layer(SHAPES[s], tokens, ns.rounds) for s in shapes]
    if not ns.skip_offline:
        report["offline"] = [bench_offline(m, w, ns.runs) for m in models for w in workloads]
    if ns.eager_ab:
        report["eager_ab"] = bench_eager_ab(ns.runs)
    report["load_average_end"] = os.getloadavg()
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
