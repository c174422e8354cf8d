#!/usr/bin/env python3
"""Benchmark the int8 / int4 panel kernels against the float32 panel kernel (issue 17).

Times, for SmolLM-135M's linear shapes (hidden 576, intermediate 1536: the fused gate/up
projection 576 -> 3072, down 1536 -> 576 and the fused q/k/v 576 -> 960) at each row count,
one pass over `--weights` distinct weights of the shape (so that, as in a real decode, they
stream from DRAM rather than the L3; each set's size is printed) in the panel layout of
`ringserve.gpu.native.panel`: float32 (`panel_f32.c`) and int8 / int4 (`panel_quant.c`,
quantized by `ringserve.gpu.layers.quant`). The kernels are called through the library's `rs_linear`
with ready arguments (the fused decode step calls them from C); what
`panel_native.linear` adds per call from Python is printed apart. The bandwidth baseline is
torch's `.sum()` over the float32 panels of the same pass: the rate at which this machine
streams memory. Each figure is the median of `--reps` rounds with the range; the rounds
interleave the variants so a noisy neighbour slows them alike. GB/s counts the bytes each
kernel reads (codes, scales and mins). Prints the machine, versions, load average, the
command and a markdown table.

    .venv/bin/python scripts/bench_quant.py [--batch 1,8,64] [--weights 30] [--threads 2]
        [--reps 5] [--shapes gate_up,down,qkv] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ringserve.gpu.layers.quant import quantize
from ringserve.gpu.native import panel as panel_native
from ringserve.gpu.native.panel import PanelWeight

HIDDEN, INTERMEDIATE, QKV = 576, 1536, 960
SHAPES = {"gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE),
          "qkv": (QKV, HIDDEN)}
FORMATS = ("f32", "int8", "int4")
BASELINE = ".sum()"


class _Shape:
    """`count` weights of one shape in every panel format, and the passes over them."""

    def __init__(self, n: int, k: int, count: int, library: ctypes.CDLL) -> None:
        gen = torch.Generator().manual_seed(n * k)
        weights = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(count)]
        self.n, self.k, self.library = n, k, library
        self._buffers: tuple[torch.Tensor, ...] = ()
        self.panels: dict[str, list[PanelWeight]] = {
            "f32": [panel_native.pack_f32(w) for w in weights],
            "int8": [quantize(w, "int8") for w in weights],
            "int4": [quantize(w, "int4") for w in weights],
        }

    def nbytes(self, fmt: str) -> int:
        """Bytes one pass of `fmt` reads."""
        return sum(p.nbytes() for p in self.panels[fmt])

    def passes(self, rows: int, threads: int) -> dict[str, Callable[[], None]]:
        """One pass over the weights per variant, for `rows` rows of x."""
        x = torch.randn(rows, self.k, generator=torch.Generator().manual_seed(1))
        y = torch.empty(rows, self.n)
        self._buffers = (x, y)  # the passes hold their addresses only
        rs_linear, xp, yp = self.library.rs_linear, x.data_ptr(), y.data_ptr()

        def run(panels: list[PanelWeight]) -> Callable[[], None]:
            structs = [ctypes.byref(p.struct) for p in panels]

            def one_pass() -> None:
                for s in structs:
                    rs_linear(s, xp, rows, yp, threads)
            return one_pass

        floats = [p.data for p in self.panels["f32"]]

        def stream() -> None:
            for t in floats:
                t.sum()

        return {BASELINE: stream, **{fmt: run(self.panels[fmt]) for fmt in FORMATS}}


def _time(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter,
          budget_s: float = 0.2) -> float:
    """Milliseconds per call, over as many calls as fit in about `budget_s` of `clock` (at
    least one)."""
    fn()
    start = clock()
    calls = 0
    while calls == 0 or clock() - start < budget_s:
        fn()
        calls += 1
    return (clock() - start) / calls * 1e3


def _wrapper_overhead_us(library: ctypes.CDLL) -> tuple[float, float]:
    """Microseconds per call of `panel_native.linear` and of bare `rs_linear` on a tiny int8
    weight at 1 row (medians of 5): the per-call cost outside the kernel."""
    weight = quantize(torch.randn(16, 32), "int8")
    x, y = torch.randn(1, 32), torch.empty(1, 16)
    struct = ctypes.byref(weight.struct)
    threads = torch.get_num_threads()
    wrapped = [_time(lambda: panel_native.linear(library, x, weight), budget_s=0.05)
               for _ in range(5)]
    bare = [_time(lambda: library.rs_linear(struct, x.data_ptr(), 1, y.data_ptr(), threads),
                  budget_s=0.05) for _ in range(5)]
    return statistics.median(wrapped) * 1e3, statistics.median(bare) * 1e3


def _l3_bytes() -> int | None:
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return None
    return int(text[:-1]) * 1024 if text.endswith("K") else int(text)


def _cell(samples: list[float], nbytes: int, f32: float, stream: float) -> str:
    """`ms (range), GB/s, speed-up over float32, share of the bandwidth baseline`."""
    ms = statistics.median(samples)
    gbs = nbytes / ms / 1e6
    return (f"{ms:.2f} ({min(samples):.2f}-{max(samples):.2f}), {gbs:.1f} GB/s, "
            f"x{f32 / ms:.2f}, {gbs / stream:.0%}")


def main() -> None:
    """Parse the flags, time every variant and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8,64", help="comma-separated row counts")
    parser.add_argument("--threads", type=int, default=2, help="torch / kernel threads")
    parser.add_argument("--weights", type=int, default=30, help="distinct weights per shape")
    parser.add_argument("--reps", type=int, default=5, help="rounds per figure (median)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="of " + ",".join(SHAPES))
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the process's CPU time, which leaves out the time it waited "
                        "for a core on a loaded machine (meaningful with --threads 1 only)")
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu sums the threads' times: use it with --threads 1")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    library = panel_native.load_library()
    if library is None:
        raise SystemExit("the panel library could not be built (see the log)")
    print(f"machine: {platform.processor() or platform.machine()}, "
          f"{torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs, "
          f"{args.threads} thread(s), {args.clock} clock")
    print(f"python {platform.python_version()}, torch {torch.__version__}")
    print("command: " + " ".join([sys.executable, *sys.argv]))
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    wrapped, bare = _wrapper_overhead_us(library)
    print(f"per call outside the kernel (16x32 int8, 1 row): panel_native.linear {wrapped:.1f} "
          f"us, bare rs_linear {bare:.1f} us")
    l3 = _l3_bytes()
    notes: list[str] = []
    print("\nEach cell: ms per pass (range), GB/s of the bytes the kernel reads, speed-up over "
          f"float32 panels, share of the {BASELINE} bandwidth baseline.\n")
    print("| shape | rows | " + " | ".join([f"{BASELINE} GB/s", *FORMATS]) + " |")
    print("|---|---:|" + "---:|" * (len(FORMATS) + 1))
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        shape = _Shape(n, k, args.weights, library)
        sizes = {fmt: shape.nbytes(fmt) for fmt in FORMATS}
        mib = "/".join(f"{sizes[fmt] / 2**20:.0f}" for fmt in FORMATS)
        label = f"{name} {n}x{k} ({mib} MiB)"
        small = [fmt for fmt in FORMATS if l3 is not None and sizes[fmt] < 2 * l3]
        if small and l3 is not None:
            notes.append(f"{name}: the {', '.join(small)} pass is under twice the L3 "
                         f"({l3 // 2**20} MiB): partly served from cache")
        for rows in (int(b) for b in args.batch.split(",")):
            fns = shape.passes(rows, args.threads)
            samples: dict[str, list[float]] = {v: [] for v in fns}
            for _ in range(args.reps):
                for v, fn in fns.items():
                    samples[v].append(_time(fn, clock))
            stream = sizes["f32"] / statistics.median(samples[BASELINE]) / 1e6
            f32 = statistics.median(samples["f32"])
            cells = [f"{stream:.1f}"] + [_cell(samples[fmt], sizes[fmt], f32, stream)
                                         for fmt in FORMATS]
            print(f"| {label} | {rows} | " + " | ".join(cells) + " |", flush=True)
    print("\n(MiB per pass: f32/int8/int4.) " + "; ".join(notes))
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
