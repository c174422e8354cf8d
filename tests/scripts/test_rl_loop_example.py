"""examples/rl_loop.py end to end (slow): a few GRPO steps on the demo model through the shm
weight transfer; the reward rises, every step sends the next weight version and the rollouts
after it report that version."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"
STEPS = 8
# Small but with enough samples per step (2 prompts x 8 completions x 8 tokens) that the
# reward takes off within the steps: about 1 s a step on an idle 2-core machine.
ARGS = ["--steps", str(STEPS), "--group-size", "8", "--prompts", "2", "--max-tokens", "8",
        "--lr", "2e-2", "--seed", "0"]
STEP_LINE = re.compile(r"^\s*(\d+)\s+(\d+\.\d+)\s+(-?\d+\.\d+)\s+(\S+)\s+(\S+)\s", re.M)
SUMMARY = re.compile(r"reward first (\d+) steps mean (\d+\.\d+) -> last \d+ steps mean (\d+\.\d+)")


def _run_example(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run the example in its own process group, killed (engine processes included) on the
    way out whatever happens."""
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_rl_loop_reward_rises_and_weight_versions_advance(demo_model_dir: Path) -> None:
    run = _run_example(ARGS, timeout=300)
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr[-4000:]}"
    steps = STEP_LINE.findall(run.stdout)
    assert [int(s[0]) for s in steps] == list(range(1, STEPS + 1)), run.stdout
    assert [s[4] for s in steps] == [str(i) for i in range(1, STEPS + 1)], run.stdout
    assert f"sample (version {STEPS}):" in run.stdout
    summary = SUMMARY.search(run.stdout)
    assert summary is not None, run.stdout
    assert float(summary.group(3)) > float(summary.group(2))
