"""What the CPU benchmark scripts bench_prefill.py, bench_prefill_attention.py and
bench_panel_rows.py share: the machine lines they print (the command, the CPU model with the
instruction-set flags that pick kernels, torch's version, CPU capability and threads, the load
average), the order of interleaved rounds and the "median (range)" cells. Plain functions
apart from reading /proc, tested as such (tests/scripts/test_bench_prefill.py).
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Flags that decide which kernels run here: torch's AVX2 / AVX-512 paths, native bf16 dot
# products (AVX512-BF16) and AMX tiles (oneDNN's bf16 / int8 GEMMs).
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
                "amx_int8")


def parse_cpuinfo(text: str) -> tuple[str, set[str]]:
    """(model name, flags) of the first processor in a /proc/cpuinfo text."""
    model, flags = "unknown CPU", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def flags_text(flags: set[str]) -> str:
    """`avx2 yes, avx512f yes, amx_bf16 no, ...` for the kernel-picking flags."""
    return ", ".join(f"{name} {'yes' if name in flags else 'no'}" for name in KERNEL_FLAGS)


def cpu_line() -> str:
    """`cpu: <model>, <n> cpus; avx2 yes, ...` for this machine."""
    try:
        model, flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        model, flags = platform.processor() or platform.machine(), set()
    return f"cpu: {model}, {os.cpu_count()} cpus; {flags_text(flags)}"


def header_lines(threads: int, extra: str = "") -> list[str]:
    """The command, the CPU line and the versions (torch, its CPU capability, threads)."""
    import torch

    versions = (f"python {platform.python_version()}, torch {torch.__version__} (CPU capability "
                f"{torch.backends.cpu.get_cpu_capability()}), {threads} threads")
    return [f"command: {command()}", cpu_line(), versions + (f", {extra}" if extra else ""),
            f"ringserve tree: {tree_version()}", f"load average at the start: {load_text()}"]


def tree_version() -> str:
    """`4bf7ab2`, or `4bf7ab2 + 3 modified files`: the commit this tree is at (read-only git
    calls: no index refresh is written)."""
    def git(*argv: str) -> str:
        run = subprocess.run(["git", "--no-optional-locks", "-C", str(ROOT), *argv],
                             capture_output=True, text=True, check=False)
        return run.stdout.strip() if run.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    modified = len(git("status", "--porcelain", "--untracked-files=no").splitlines())
    return f"{head} + {modified} modified files" if modified else head


def command() -> str:
    """The command line as typed (the interpreter's name, the script and its arguments)."""
    return shlex.join([Path(sys.executable).name, *sys.argv])


def load_text() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def load_warning() -> str | None:
    """A warning when the 5-minute load average exceeds the CPUs: other work shared them."""
    load = os.getloadavg()[1]
    cpus = os.cpu_count() or 1
    if load > cpus + 0.5:  # this run's own threads count in it too
        return (f"WARNING: the 5-minute load average ({load:.2f}) exceeds the {cpus} cpus: "
                "other work shared the cores, the figures are not clean")
    return None


def rotated(items: Sequence[str], shift: int) -> list[str]:
    """`items` rotated left by `shift`: the order of one interleaved round, so that no side
    always runs first (or always right after another)."""
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def median_range(values: Sequence[float], digits: int = 1, thousands: bool = False) -> str:
    """`median (min-max)` of `values`, e.g. `1,234.5 (1,200.0-1,300.2)`."""
    spec = f"{',' if thousands else ''}.{digits}f"
    med = statistics.median(values)
    return f"{med:{spec}} ({min(values):{spec}}-{max(values):{spec}})"
