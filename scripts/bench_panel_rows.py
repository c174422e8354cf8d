#!/usr/bin/env python3
"""Float32 linears by row count (issue 48, item 2): the panel kernel against torch's GEMM, on
SmolLM2-135M's shapes, and where `panel.linear` hands many-row calls to torch.

Three ways to compute `x @ W^T + b` for float32 `x` [rows, k], ms per call:
- panel kernel: `ringserve.gpu.native.panel.linear` with the hand-off off (`MANY_ROWS` raised
  past any row count for the call): the C kernel (`panel_f32.c`) on the packed panels;
- F.linear: torch's `F.linear` on the plain [n, k] weight (MKL / oneDNN), what transformers'
  forward runs: the baseline;
- hand-off: `panel.linear` with `MANY_ROWS` lowered to 1 for the call: `_many_rows`, i.e. W^T
  read out of the panels (a weight-sized copy) and then `addmm`.
"linear() takes" says which of the two the engine's `panel.linear` runs at that row count
(from `MANY_ROWS` as this tree sets it). Each shape holds one weight (so it is cache-resident
for the smaller shapes; the LM head is not). After one warm-up call of each, `--reps` rounds
call each way once, the order rotating each round, so a busy neighbour slows them alike;
cells are medians (range). Ratios are of medians: kernel / hand-off > 1 means the hand-off is
faster; the max relative difference is |hand-off - kernel| / max |kernel|.

    .venv/bin/python scripts/bench_panel_rows.py [--rows 1,8,32,128,256,512,1024,2048]
        [--shapes qkv,o,gate_up,down,lm_head] [--reps 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from cpu_bench import header_lines, load_text, load_warning, median_range, rotated

# SmolLM2-135M: hidden 576, intermediate 1536, 9 + 2 x 3 heads of 64, vocab 49152 (tied head).
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
DEFAULT_ROWS = "1,8,32,128,256,512,1024,2048"
WAYS = ("panel kernel", "F.linear", "hand-off")


@contextlib.contextmanager
def many_rows_at(rows: int) -> Iterator[None]:
    """`panel.MANY_ROWS` set to `rows` for the block (restored after)."""
    from ringserve.gpu.native import panel

    previous = panel.MANY_ROWS
    panel.MANY_ROWS = rows
    try:
        yield
    finally:
        panel.MANY_ROWS = previous


def ways(library: Any, x: Any, weight: Any, bias: Any, packed: Any) -> dict[str, Callable[[], Any]]:
    """The three ways (see the module docstring) as functions of no arguments."""
    import torch.nn.functional as F

    from ringserve.gpu.native import panel

    def kernel() -> Any:
        with many_rows_at(sys.maxsize):
            return panel.linear(library, x, packed)

    def hand_off() -> Any:
        with many_rows_at(1):
            return panel.linear(library, x, packed)

    return {"panel kernel": kernel, "F.linear": lambda: F.linear(x, weight, bias),
            "hand-off": hand_off}


def measure(library: Any, name: str, rows: list[int], reps: int) -> list[str]:
    """The table rows of one shape."""
    import torch

    from ringserve.gpu.native import panel

    n, k = SHAPES[name]
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen) * 0.1
    packed = panel.pack_f32(weight, bias)
    lines = []
    for m in rows:
        x = torch.randn(m, k, generator=gen)
        fns = ways(library, x, weight, bias, packed)
        first = {key: fn() for key, fn in fns.items()}  # warm-up, and the results to compare
        scale = first["panel kernel"].abs().max().item() or 1.0
        diff = (first["hand-off"] - first["panel kernel"]).abs().max().item() / scale
        times: dict[str, list[float]] = {key: [] for key in fns}
        for rep in range(reps):
            for key in rotated(WAYS, rep):
                start = time.perf_counter()
                fns[key]()
                times[key].append((time.perf_counter() - start) * 1e3)
        med = {key: statistics.median(ts) for key, ts in times.items()}
        takes = "hand-off" if m >= panel.MANY_ROWS else "kernel"
        cells = " | ".join(median_range(times[key], 2, thousands=True) for key in WAYS)
        lines.append(f"| {name} {n}x{k} | {m:,} | {cells} | "
                     f"{med['panel kernel'] / med['hand-off']:.2f} | "
                     f"{med['panel kernel'] / med['F.linear']:.2f} | {diff:.1e} | {takes} |")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    first_paragraph = (__doc__ or "").split("\n\n")[0]
    parser = argparse.ArgumentParser(description=" ".join(first_paragraph.split()))
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="comma-separated row counts")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--reps", type=int, default=5, help="interleaved calls per way")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        args.rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows: comma-separated integers, got {args.rows!r}")
    args.shapes = args.shapes.split(",")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or min(args.rows) < 1 or args.reps < 1 or args.threads < 1:
        parser.error(f"--shapes of {', '.join(SHAPES)} (unknown: {unknown}); --rows, --reps, "
                     "--threads >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    from ringserve.gpu.native import panel

    torch.set_num_threads(args.threads)
    library = panel.load_library()
    if library is None:
        print("the panel library could not be built (see the log): nothing to measure",
              file=sys.stderr)
        return 1
    for line in header_lines(args.threads, f"panel.MANY_ROWS = {panel.MANY_ROWS}"):
        print(line)
    print(f"ms per call, median (range) of {args.reps} rounds, order rotating; ratios of medians")
    print()
    print("| shape (n x k) | rows | panel kernel | F.linear | hand-off | kernel / hand-off "
          "| kernel / F.linear | max rel diff | linear() takes |")
    print("|---|---|---|---|---|---|---|---|---|")
    started = time.perf_counter()
    for name in args.shapes:
        for line in measure(library, name, args.rows, args.reps):
            print(line, flush=True)
    print(f"\nload average at the end: {load_text()}; {time.perf_counter() - started:.0f} s")
    warning = load_warning()
    if warning:
        print(warning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
