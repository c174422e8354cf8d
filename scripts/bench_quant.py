#!/usr/bin/env python3
"""Benchmark the weight-only int8 / int4 matmuls against float32 (issue 17, item 4).

Times, for SmolLM-135M's linear shapes (hidden 576, intermediate 1536: the fused q/k/v
projection 576 -> 960, o 576 -> 576, the fused gate/up 576 -> 3072 and down 1536 -> 576) at
each batch size: `F.linear` on the float32 weight, the engine's float32 path (oneDNN's packed
weight, `ringserve.gpu.linear.apply_linear`), and `ringserve.gpu.quant.quantized_linear` on
int8 weights (the project's C kernel, and torch's `_weight_int8pack_mm`) and int4 weights
(torch's `_weight_int4pack_mm_for_cpu`). Each figure is one pass over `--layers` decoder
layers' four products, each layer its own weights (so, as in a real decode, the weights do not
stay in cache), in milliseconds: the median of `--reps` rounds with the range; the rounds
interleave the variants so a noisy neighbour slows them alike. Prints the machine, versions,
the command and a markdown table.

    .venv/bin/python scripts/bench_quant.py [--batch 1,8,64] [--layers 8] [--threads 1]
        [--reps 3]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ringserve.gpu import quant_native
from ringserve.gpu.linear import apply_linear, pack_weight
from ringserve.gpu.quant import QuantizedWeight, nbytes, quantize, quantized_linear

HIDDEN, INTERMEDIATE, KV = 576, 1536, 192
SHAPES = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN),
          (HIDDEN, INTERMEDIATE)]
VARIANTS = ("float32 F.linear", "float32 oneDNN", "int8 C kernel", "int8 torch", "int4 torch")


class _Model:
    """`layers` layers' weights in every form the variants read."""

    def __init__(self, layers: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.weights = [torch.randn(n, k, generator=gen) * 0.02
                        for _ in range(layers) for n, k in SHAPES]
        self.packed = [pack_weight(w) for w in self.weights]
        self.int8 = [quantize(w, "int8") for w in self.weights]
        self.int4 = [quantize(w, "int4") for w in self.weights]

    def passes(self, batch: int) -> dict[str, Callable[[], None]]:
        """One pass over every layer, per variant, for `batch` rows."""
        gen = torch.Generator().manual_seed(1)
        inputs = [torch.randn(batch, k, generator=gen) for _, k in SHAPES]
        kernel = quant_native.load_kernel()
        if kernel is None:
            raise SystemExit("the int8 C kernel could not be built (see the log)")

        def run(fn: Callable[[int, torch.Tensor], object]) -> Callable[[], None]:
            def one_pass() -> None:
                for i in range(len(self.weights)):
                    fn(i, inputs[i % len(SHAPES)])
            return one_pass

        def torch_int8(q: QuantizedWeight, x: torch.Tensor) -> object:
            return torch.ops.aten._weight_int8pack_mm(x, q.packed, q.scales)

        return {
            "float32 F.linear": run(lambda i, x: F.linear(x, self.weights[i])),
            "float32 oneDNN": run(lambda i, x: apply_linear(x, self.weights[i], self.packed[i])),
            "int8 C kernel": run(lambda i, x: quant_native.int8_linear(
                kernel, x, self.int8[i].packed, self.int8[i].scales)),
            "int8 torch": run(lambda i, x: torch_int8(self.int8[i], x)),
            "int4 torch": run(lambda i, x: quantized_linear(x, self.int4[i])),
        }


def _time(fn: Callable[[], None], budget_s: float = 0.3) -> float:
    """Milliseconds per call, over as many calls as fit in about `budget_s` (at least one)."""
    fn()
    start = time.perf_counter()
    calls = 0
    while calls == 0 or time.perf_counter() - start < budget_s:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    """Parse the flags, time every variant and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8,64", help="comma-separated row counts")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers per pass")
    parser.add_argument("--reps", type=int, default=3, help="rounds per figure (median)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.processor() or platform.machine()}, "
          f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s)")
    print(f"python {platform.python_version()}, torch {torch.__version__}")
    print("command: " + " ".join([sys.executable, *sys.argv]))
    sizes = {name: sum(nbytes(quantize(torch.randn(n, k), name)) for n, k in SHAPES)
             for name in ("int8", "int4")}
    floats = sum(n * k * 4 for n, k in SHAPES)
    print(f"weight bytes per layer: float32 {floats}, int8 {sizes['int8']}, "
          f"int4 {sizes['int4']}")
    model = _Model(args.layers)
    print("\n| rows | " + " | ".join(VARIANTS) + " |")
    print("|---:|" + "---:|" * len(VARIANTS))
    for batch in (int(b) for b in args.batch.split(",")):
        fns = model.passes(batch)
        samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.reps):
            for name in VARIANTS:
                samples[name].append(_time(fns[name]))
        cells = [f"{statistics.median(s):.2f} ({min(s):.2f}-{max(s):.2f})"
                 for s in samples.values()]
        print(f"| {batch} | " + " | ".join(cells) + " |")
    print(f"\n(ms per pass over {args.layers} layers' four linears: median of rounds, range "
          "in parentheses)")


if __name__ == "__main__":
    main()
