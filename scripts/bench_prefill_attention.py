#!/usr/bin/env python3
"""Per-layer prefill attention, this tree's `ringserve.gpu.attention.torch_ref` against the same
file at an earlier revision (issue 48, item 1): milliseconds per call, or (`--memory`) the peak
extra memory of one call.

The baseline is `src/gpu/attention/torch_ref.py` as `git show REV:...` prints it (REV default
95a1f77~1, before the 4-D flash calls and tiles), written to a temporary file and imported as
a module of its own; it meets this tree's `AttentionMetadata`. Both sides get the same inputs:
one request of SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head dim 64, block
size 16) whose N new tokens follow CTX cached ones (a case `N:CTX`; CTX 0 is a fresh prompt),
a random query [N, 9, 64] and a random paged KV cache holding all N + CTX positions, through
`paged_attention` (plan included, as a layer without a kept plan pays it), with an optional
sliding window and logit soft cap.

Timing (default): per dtype and case, the first call of each side is the warm-up and gives
the max |new - old| difference; then `--reps` interleaved rounds (old, new, old, new, ...: a
busy neighbour slows both alike) of one call each. Cells are ms, median (range); speed-up is
old median / new median.

`--memory`: each (dtype, case, side) runs in a child process of its own with
MALLOC_MMAP_THRESHOLD_=65536, so every large buffer is its own mmap, returned to the system
when freed: the child makes the inputs, warms up with one call (the plan's own buffers), then
resets the high-water mark (/proc/self/clear_refs 5) and reads VmHWM - VmRSS around a second
call. The figure counts the [N, 9, 64] result, printed beside it. Issue 48's bound: <= 64 MiB
extra for an 8,000-token prompt.

    .venv/bin/python scripts/bench_prefill_attention.py [--rev 95a1f77~1]
        [--cases 512:0,2048:0,4096:0,8000:0,2048:2048] [--dtypes float32,bfloat16]
        [--window W] [--cap C] [--reps 3] [--threads 2] [--skip-old-over TOKENS] [--memory]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from cpu_bench import header_lines, load_text, load_warning, median_range

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "src/gpu/attention/torch_ref.py"
DEFAULT_REV = "95a1f77~1"
DEFAULT_CASES = "512:0,2048:0,4096:0,8000:0,2048:2048"
# SmolLM2-135M's attention: query heads, KV heads, head dim; ringserve's default block size.
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
MIB = 1 << 20


def parse_cases(text: str) -> list[tuple[int, int]]:
    """`512:0,2048:2048` -> [(512, 0), (2048, 2048)]: new tokens, cached tokens before them.

    Raises:
        ValueError: a case that is not N:CTX with N >= 1 and CTX >= 0.
    """
    cases = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+):(\d+)\s*", item)
        if match is None or int(match[1]) < 1:
            raise ValueError(f"case {item!r}: expected N:CTX (new tokens >= 1, cached >= 0)")
        cases.append((int(match[1]), int(match[2])))
    return cases


def case_label(n: int, ctx: int) -> str:
    """`4,096 fresh` or `2,048 after 2,048`."""
    return f"{n:,} after {ctx:,}" if ctx else f"{n:,} fresh"


@contextlib.contextmanager
def baseline_module(rev: str) -> Iterator[tuple[ModuleType, str]]:
    """`torch_ref.py` as it was at `rev`, imported from a temporary file; (module, commit)."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{sha}:{SOURCE}"], check=True,
                          capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory(prefix="torch_ref_old-") as tmp:
        path = Path(tmp) / f"torch_ref_{sha}.py"
        path.write_text(text)
        yield load_module(path), sha


def load_module(path: Path) -> ModuleType:
    """Import a file as a module named after it."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def make_inputs(n: int, ctx: int, dtype: Any) -> tuple[Any, Any, Any]:
    """(query [n, 9, 64], paged KV cache, metadata) of one request: n new tokens after ctx
    cached ones, blocks 1.. in order (block 0 unused, as the engine's null block)."""
    import torch

    from ringserve.gpu.attention.metadata import AttentionMetadata

    gen = torch.Generator().manual_seed(n * 7919 + ctx)
    seq = n + ctx
    blocks = -(-seq // BLOCK)
    cache = torch.randn(2, blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(ctx, seq) + BLOCK,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([seq], dtype=torch.int32),
        block_table=torch.arange(1, blocks + 1, dtype=torch.int32)[None],
        token_to_req=torch.zeros(n, dtype=torch.int32),
        max_query_len=n, max_seq_len=seq, query_start_loc_cpu=[0, n], seq_lens_cpu=[seq])
    query = torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return query, cache, meta


def attention_call(module: ModuleType, inputs: tuple[Any, Any, Any], window: int | None,
                   cap: float | None) -> Callable[[], Any]:
    """One layer's `paged_attention` on `inputs`, as a function of no arguments."""
    query, cache, meta = inputs

    def call() -> Any:
        return module.paged_attention(query, cache, meta, HEAD_DIM ** -0.5,
                                      sliding_window=window, logits_soft_cap=cap)
    return call


def timed_ms(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


# -- timing ------------------------------------------------------------------------------------


def time_case(old: ModuleType, new: ModuleType, n: int, ctx: int, dtype: Any,
              args: argparse.Namespace) -> str:
    """The table row of one (dtype, case)."""
    inputs = make_inputs(n, ctx, dtype)
    new_call = attention_call(new, inputs, args.window, args.cap)
    old_call = attention_call(old, inputs, args.window, args.cap)
    got = new_call()  # warm-up, and the result to compare
    dname = str(dtype).removeprefix("torch.")
    if n + ctx > args.skip_old_over:
        new_ms = [timed_ms(new_call) for _ in range(args.reps)]
        return f"| {dname} | {case_label(n, ctx)} | (skipped) | {median_range(new_ms)} | | |"
    want = old_call()
    diff = (got.float() - want.float()).abs().max().item()
    del got, want
    old_ms: list[float] = []
    new_ms = []
    for _ in range(args.reps):
        old_ms.append(timed_ms(old_call))
        new_ms.append(timed_ms(new_call))
    speedup = statistics.median(old_ms) / statistics.median(new_ms)
    return (f"| {dname} | {case_label(n, ctx)} | {median_range(old_ms, thousands=True)} | "
            f"{median_range(new_ms, thousands=True)}"
            f" | {speedup:.1f}x | {diff:.1e} |")


def run_timing(args: argparse.Namespace) -> None:
    import torch

    from ringserve.gpu.attention import torch_ref as new

    with baseline_module(args.rev) as (old, sha):
        print(f"old: {SOURCE} at {args.rev} ({sha}); new: this tree's; "
              f"window {args.window}, soft cap {args.cap}; ms per layer call, median (range) of "
              f"{args.reps} interleaved calls after one warm-up each")
        print()
        print("| dtype | prompt | old ms | new ms | speed-up | max abs diff |")
        print("|---|---|---|---|---|---|")
        for dname in args.dtypes:
            for n, ctx in args.cases:
                print(time_case(old, new, n, ctx, getattr(torch, dname), args), flush=True)


# -- memory ------------------------------------------------------------------------------------


def _status_kib(key: str) -> int:
    match = re.search(key + r":\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert match is not None
    return int(match[1])


def memory_child(spec: dict[str, Any]) -> dict[str, float]:
    """In the child: the peak extra memory of one call (MiB) and its result's size (MiB)."""
    import torch

    torch.set_num_threads(spec["threads"])
    if spec["which"] == "old":
        module = load_module(Path(spec["old_file"]))
    else:
        from ringserve.gpu.attention import torch_ref as module
    inputs = make_inputs(spec["n"], spec["ctx"], getattr(torch, spec["dtype"]))
    call = attention_call(module, inputs, spec["window"], spec["cap"])
    call()  # warm-up: one-time buffers are not the call's
    gc.collect()
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    out = call()
    peak = _status_kib("VmHWM")
    return {"peak_extra_mib": (peak - before) / 1024,
            "result_mib": out.numel() * out.element_size() / MIB}


def run_memory(args: argparse.Namespace) -> None:
    with baseline_module(args.rev) as (old, sha):
        old_file = old.__file__
        print(f"old: {SOURCE} at {args.rev} ({sha}); new: this tree's; window {args.window}, "
              f"soft cap {args.cap}; peak extra memory of one layer call (VmHWM - VmRSS before "
              "it, after a warm-up call), one child process each, MALLOC_MMAP_THRESHOLD_=65536")
        print()
        print("| dtype | prompt | old MiB | new MiB | the result [N, 9, 64], MiB |")
        print("|---|---|---|---|---|")
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536",
               "OMP_NUM_THREADS": str(args.threads)}
        for dname in args.dtypes:
            for n, ctx in args.cases:
                cells = {}
                for which in ("old", "new"):
                    if which == "old" and n + ctx > args.skip_old_over:
                        cells[which] = None
                        continue
                    spec = {"which": which, "old_file": old_file, "n": n, "ctx": ctx,
                            "dtype": dname, "window": args.window, "cap": args.cap,
                            "threads": args.threads}
                    run = subprocess.run(
                        [sys.executable, __file__, "--memory-child", json.dumps(spec)],
                        env=env, capture_output=True, text=True, check=False)
                    if run.returncode != 0:
                        raise RuntimeError(f"memory child {spec} failed:\n{run.stderr}")
                    cells[which] = json.loads(run.stdout.strip().splitlines()[-1])
                old_cell = "(skipped)" if cells["old"] is None \
                    else f"{cells['old']['peak_extra_mib']:,.1f}"
                new = cells["new"]
                assert new is not None
                print(f"| {dname} | {case_label(n, ctx)} | {old_cell} | "
                      f"{new['peak_extra_mib']:,.1f} | {new['result_mib']:.1f} |", flush=True)


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    first_paragraph = (__doc__ or "").split("\n\n")[0]
    parser = argparse.ArgumentParser(description=" ".join(first_paragraph.split()))
    parser.add_argument("--rev", default=DEFAULT_REV,
                        help=f"the baseline's git revision (default {DEFAULT_REV})")
    parser.add_argument("--cases", default=DEFAULT_CASES,
                        help="N:CTX items: N new tokens after CTX cached ones (CTX 0: fresh)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--window", type=int, default=None, help="sliding window (tokens)")
    parser.add_argument("--cap", type=float, default=None, help="logit soft cap")
    parser.add_argument("--reps", type=int, default=3, help="interleaved calls per side")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-old-over", type=int, default=1 << 30, metavar="TOKENS",
                        help="run only the new side where N + CTX exceeds this")
    parser.add_argument("--memory", action="store_true",
                        help="peak extra memory per call instead of time")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.cases = parse_cases(args.cases)
    except ValueError as exc:
        parser.error(str(exc))
    args.dtypes = [d.strip() for d in args.dtypes.split(",")]
    bad = [d for d in args.dtypes if d not in ("float32", "bfloat16", "float16")]
    if bad or args.reps < 1 or args.threads < 1:
        parser.error(f"--dtypes: float32, bfloat16 or float16 (got {bad}); --reps, --threads >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(json.loads(args.memory_child))))
        return 0
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    for line in header_lines(args.threads):
        print(line)
    started = time.perf_counter()
    if args.memory:
        run_memory(args)
    else:
        run_timing(args)
    print(f"\nload average at the end: {load_text()}; {time.perf_counter() - started:.0f} s")
    warning = load_warning()
    if warning:
        print(warning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
