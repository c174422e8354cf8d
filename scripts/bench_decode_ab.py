#!/usr/bin/env python3
"""Batch decode throughput of this tree against an earlier commit's (issue 17, item 6: batch-32
throughput >= 1.5x the engine's before the issue's work), on the same workload, same run.

Each tree runs in its own child process: the earlier commit from a git worktree under
.cache/decode_ab/ (a `ringserve` link to its src/ put first on PYTHONPATH; its C kernels build
into its own RINGSERVE_HOME), this tree from src/. A child holds one `LLM` on the SmolLM-135M
shape (`load_format="dummy"`, float32, the tree's default settings: the captured decode step
where it has one) and times B concurrent greedy streams of --prompt-len random token ids
(end of sequence ignored), `generate` at max_tokens 1 and at 1 + --steps after a warm-up
call of each (the prompts are prefix-cached): ms per token = the difference / --steps, --reps times
per child; every output's token count is checked. The trees alternate for --rounds rounds;
the figure per tree is the median over every repetition of every round, with the range, and
the speed-up is also given paired by round (each round's two medians, taken back to back).

    .venv/bin/python scripts/bench_decode_ab.py [--baseline c903fc4] [--batch 32]
        [--prompt-len 64] [--steps 16] [--reps 3] [--rounds 3] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "decode_ab"

CHILD = r"""
import json, random, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from profile_decode import smol_135m_dir
from ringserve import LLM, SamplingParams

args = json.loads(sys.argv[1])
tmp = Path(tempfile.mkdtemp(prefix="decode-ab-"))
llm = LLM(model=str(smol_135m_dir(tmp)), load_format="dummy", device="cpu",
          max_num_seqs=args["batch"], max_model_len=args["prompt_len"] + args["steps"] + 16,
          disable_log_stats=True)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 7900) for _ in range(args["prompt_len"])]}
           for _ in range(args["batch"])]

def run(n):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    counts = sorted(len(o.outputs[0].token_ids) for o in outs)
    if counts != [n] * len(prompts):
        raise SystemExit(f"token counts {counts}, wanted {n} each")
    return elapsed

run(1)
run(1 + args["steps"])
times = []
for _ in range(args["reps"]):
    one = run(1)
    many = run(1 + args["steps"])
    times.append(1e3 * (many - one) / args["steps"])
print("RESULT " + json.dumps(times), flush=True)
llm.close()
import os
os._exit(0)
"""


def worktree(rev: str) -> Path:
    """A checkout of `rev` under .cache/decode_ab/, with the `ringserve` link its child
    imports through; made when absent."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    tree = CACHE / sha[:12]
    if not (tree / "src").is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), sha],
                       check=True, capture_output=True)
    link = tree / "pkg" / "ringserve"
    if not link.exists():
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(tree / "src")
    return tree


def run_child(tree: Path | None, params: dict[str, Any], threads: int) -> list[float]:
    """One child's ms per token (one figure per repetition); tree None: this checkout."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree / "pkg"), env.get("PYTHONPATH", "")])
        env["RINGSERVE_HOME"] = str(tree / ".ringserve-home")
    with tempfile.TemporaryFile("w+") as out:
        done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(params),
                               str(ROOT / "scripts")], env=env, stdout=out,
                              stderr=subprocess.STDOUT, check=False, timeout=1200,
                              start_new_session=True)
        out.seek(0)
        text = out.read()
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"child for {tree or 'this tree'} failed ({done.returncode}):\n"
                         f"{text[-3000:]}")
    times: list[float] = json.loads(lines[-1][len("RESULT "):])
    return times


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="0db456c",
                        help="the earlier commit (default: 0db456c, the tree issue 17 was filed on)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    params = {"batch": args.batch, "prompt_len": args.prompt_len, "steps": args.steps,
              "reps": args.reps}
    base = worktree(args.baseline)
    results: dict[str, list[float]] = {"baseline": [], "this tree": []}
    ratios: list[float] = []  # per round: the baseline's median over this tree's
    load = [os.getloadavg()[0]]
    start = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    for r in range(args.rounds):
        order = [("baseline", base), ("this tree", None)]
        medians = {}
        for name, tree in order if r % 2 == 0 else order[::-1]:
            times = run_child(tree, params, args.threads)
            results[name] += times
            medians[name] = statistics.median(times)
            print(f"round {r + 1} {name}: {', '.join(f'{t:.1f}' for t in times)} ms/token",
                  file=sys.stderr, flush=True)
        ratios.append(medians["baseline"] / medians["this tree"])
    load.append(os.getloadavg()[0])
    base_ms = statistics.median(results["baseline"])
    ours_ms = statistics.median(results["this tree"])
    print(f"run {start} UTC - {time.strftime('%H:%M:%S', time.gmtime())}, load average "
          f"{load[0]:.2f} at the start, {load[1]:.2f} at the end; batch {args.batch}, "
          f"{args.prompt_len} prompt tokens, {args.steps} steps, {args.threads} threads")
    print("| tree | ms per step | tokens/s |")
    print("|---|---:|---:|")
    for name, ms in (("baseline " + args.baseline, base_ms), ("this tree", ours_ms)):
        key = "baseline" if name.startswith("baseline") else "this tree"
        print(f"| {name} | {summary(results[key])} | {1e3 * args.batch / ms:.0f} |")
    print(f"speed-up (median over median): {base_ms / ours_ms:.2f}x; paired by round (the two "
          f"trees' medians of one round, run back to back, so a drift of the machine over the "
          f"run cancels): median {statistics.median(ratios):.2f}x "
          f"({min(ratios):.2f}-{max(ratios):.2f}) over {len(ratios)} rounds")
    if args.json is not None:
        args.json.write_text(json.dumps({"params": params, "baseline": args.baseline,
                                         "results": results, "round_ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
