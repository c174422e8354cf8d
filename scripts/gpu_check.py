#!/usr/bin/env python3
"""The one-command GPU check of issue 46, item 1 (run through `scripts/gpu_check`).

On a GPU machine with Python 3.12, torch, triton and transformers but no package registry, it
installs the wheels `scripts/gpu_wheels` put in `.whl/` (no network), links the source tree in
as the package `ringserve`, then runs these steps, each in its own process group with its own
time budget, so that a crash or a hang in one is recorded and the rest still run:

  install     the wheels into a scratch folder; versions of python, torch, triton, transformers
  pytest_gpu  `pytest -m gpu` over tests/ (per-test outcomes read from its output)
  kernels     every Triton kernel (KV write, paged attention, fused MoE) natively against the
              torch reference at serving shapes: bf16, head dims 64 and 128, block sizes 16
              and 32, GQA 32:8, 1 to 256 sequences, contexts to 8k, decodes and prefill chunks
  decode      decode step time at batch 1 / 8 / 64 / 256 of a Llama-3.2-1B-shaped model with
              random bf16 weights, against the roofline: (weight + KV bytes) / the copy
              bandwidth measured in the same process
  throughput  offline `LLM.generate` vs transformers `generate` (one left-padded batch) on the
              same model and GPU, one after the other in the same step
  serve       `ringserve bench serve`, 256 concurrent requests, against a local `ringserve serve`
  chaos       the chaos suite's worker-kill case with TP=1 on the GPU: SIGKILL the worker under
              streams, every stream ends, /fault_tolerance/apply retry, healthy, same greedy text

It writes `gpu_check.json` (one entry per step: name, status ok / failed / skipped, seconds,
figures, error or reason) and `gpu_check.log` (every step's output) under `$OUT`.

Why the source is linked rather than installed: the package maps `ringserve` to `src/`
(pyproject's package-dir), so a symbolic link `<site>/ringserve -> src` on PYTHONPATH imports
exactly the working tree, with no build step and no stale wheel; `python -m ringserve.cli`
stands in for the console script.

`--cpu-dry-run` runs every step end to end on CPU at tiny sizes (the Triton step under
TRITON_INTERPRET=1 on two small shapes, 4 concurrent requests, one chaos round) with `.venv`'s
Python, checks that the wheels install for CPython 3.12 (into a scratch folder, not imported),
and writes the same summary ($OUT defaults to a new temporary folder). A piece that needs CUDA
is reported as skipped with its reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
# The whole run must end inside the device tool's 10-minute command limit with room to spare.
TOTAL_BUDGET_S = 570.0


@dataclass(frozen=True)
class StepSpec:
    """A step and its time budgets (seconds) on the GPU and in the CPU dry run."""

    name: str
    gpu_s: float
    dry_s: float


STEPS = (
    StepSpec("pytest_gpu", 150, 180),
    StepSpec("kernels", 75, 120),
    StepSpec("decode", 80, 90),
    StepSpec("throughput", 80, 90),
    StepSpec("serve", 75, 90),
    StepSpec("chaos", 60, 90),
)
INSTALL_BUDGET_S = 45.0


class Skip(Exception):
    """A step (or part of one) that cannot run here; the message says why."""


@dataclass(frozen=True)
class Ctx:
    """What a step's process knows: the mode, the device and a scratch folder shared by steps."""

    dry: bool
    scratch: Path
    budget_s: float = 0.0

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"


# -- orchestration (standard library only: it runs before the wheels are installed) ----------


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run_logged(cmd: list[str], log: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run `cmd` in a new process group, appending its output to `log`.

    Returns (exit status, its output); status 124 after a timeout, when the whole group
    (servers and workers the step started included) is killed.
    """
    with tempfile.TemporaryFile("w+") as buf:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=buf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = 124
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind
            proc.wait()
        buf.seek(0)
        text = buf.read()
    with log.open("a") as f:
        f.write(text)
    return code, text


def _install(dry: bool, site: Path, log: Path, env: dict[str, str]) -> dict[str, Any]:
    """The install step: wheels into `site` (GPU) or a cp312 trial install (dry run)."""
    wheels = sorted(str(p) for p in WHEELS.glob("*.whl"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site)]
    figures: dict[str, Any] = {"wheels": len(wheels),
                               "wheel_mib": round(sum(Path(w).stat().st_size
                                                      for w in wheels) / 2**20, 1)}
    if dry:
        if not wheels:
            raise Skip("no .whl folder (run scripts/gpu_wheels); the dry run uses .venv")
        pip += ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
                *(a for n in range(39, 16, -1) for a in ("--platform", f"manylinux_2_{n}_x86_64")),
                "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]
        figures["note"] = "dry run: installed for CPython 3.12 into a scratch folder, not imported"
    elif not wheels:
        raise RuntimeError("no wheels in .whl/: run scripts/gpu_wheels on a machine with PyPI")
    code, out = _run_logged([*pip, *wheels], log, env, INSTALL_BUDGET_S)
    if code != 0:
        raise RuntimeError(f"pip install exited {code}: {_tail(out)}")
    if not dry:
        link = site / "ringserve"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(ROOT / "src", target_is_directory=True)
    probe = ("import json, platform, torch, triton, transformers; print(json.dumps({"
             "'python': platform.python_version(), 'torch': torch.__version__, "
             "'triton': triton.__version__, 'transformers': transformers.__version__, "
             "'cuda': torch.cuda.is_available() and torch.cuda.get_device_name(0)}))")
    code, out = _run_logged([sys.executable, "-c", probe], log, env, 60)
    if code == 0:
        figures["versions"] = json.loads(out.strip().splitlines()[-1])
    return figures


def _step_env(dry: bool, site: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not dry:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    return env


def _record(name: str, start: float, budget: float, **fields: Any) -> dict[str, Any]:
    entry = {"name": name, "status": "ok", "seconds": round(time.monotonic() - start, 2),
             "budget_s": budget, "figures": {}, "error": None, "reason": None}
    entry.update(fields)
    return entry


def _run_child(spec: StepSpec, budget: float, ctx: Ctx, env: dict[str, str],
               log: Path) -> dict[str, Any]:
    """One step in its own process; the result file it writes, or the failure it died of."""
    start = time.monotonic()
    result = ctx.scratch / f"{spec.name}.result.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--step", spec.name,
           "--result", str(result), "--scratch", str(ctx.scratch), "--budget", str(budget)]
    if ctx.dry:
        cmd.append("--cpu-dry-run")
    if spec.name == "kernels" and ctx.dry:
        env = {**env, "TRITON_INTERPRET": "1"}  # must be set before the kernels are defined
    code, out = _run_logged(cmd, log, env, budget)
    got = json.loads(result.read_text()) if result.exists() else {}
    if code == 124:
        return _record(spec.name, start, budget, status="failed", figures=got.get("figures", {}),
                       error=f"timed out after {budget:.0f} s; last output:\n{_tail(out)}")
    if code != 0 or not got:
        return _record(spec.name, start, budget, status="failed", figures=got.get("figures", {}),
                       error=got.get("error") or f"exit status {code}:\n{_tail(out)}")
    return _record(spec.name, start, budget, status=got["status"], figures=got["figures"],
                   reason=got.get("reason"), error=got.get("error"))


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node(),
                            "cpus": os.cpu_count()}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
        if smi.returncode == 0:
            info["gpus"] = smi.stdout.strip().splitlines()
    return info


def orchestrate(dry: bool, out: Path, only: list[str] | None) -> dict[str, Any]:
    """Run the install and every step; write and return the summary."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "gpu_check.log"
    log.write_text(f"gpu_check {'--cpu-dry-run' if dry else ''} {time.ctime()}\n")
    scratch = Path(tempfile.mkdtemp(prefix="ringserve-gpu-check-"))
    site = Path(os.environ.get("RINGSERVE_GPU_SITE", scratch / "site"))
    env = _step_env(dry, site)
    ctx = Ctx(dry=dry, scratch=scratch)
    began = time.monotonic()
    steps: list[dict[str, Any]] = []
    start = time.monotonic()
    with log.open("a") as f:
        f.write("\n===== install\n")
    try:
        steps.append(_record("install", start, INSTALL_BUDGET_S,
                             figures=_install(dry, site, log, env)))
    except Skip as exc:
        steps.append(_record("install", start, INSTALL_BUDGET_S, status="skipped",
                             reason=str(exc)))
    except Exception as exc:
        steps.append(_record("install", start, INSTALL_BUDGET_S, status="failed",
                             error=f"{type(exc).__name__}: {exc}"))
    for spec in STEPS:
        if only and spec.name not in only:
            continue
        left = TOTAL_BUDGET_S - (time.monotonic() - began)
        budget = min(spec.dry_s if dry else spec.gpu_s, left)
        with log.open("a") as f:
            f.write(f"\n===== {spec.name} (budget {budget:.0f} s)\n")
        if budget < 5:
            steps.append(_record(spec.name, time.monotonic(), budget, status="skipped",
                                 reason=f"the run's {TOTAL_BUDGET_S:.0f} s budget is spent"))
            continue
        entry = _run_child(spec, budget, ctx, dict(env), log)
        steps.append(entry)
        print(f"{spec.name}: {entry['status']} in {entry['seconds']} s", flush=True)
    summary = {"schema": 1, "mode": "cpu-dry-run" if dry else "gpu",
               "seconds": round(time.monotonic() - began, 1), "machine": _machine(),
               "log": str(log), "ok": all(s["status"] != "failed" for s in steps),
               "steps": steps}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


# -- the steps' shared pieces (run in the step processes: torch and ringserve importable) -----

# Llama-3.2-1B's shape (random weights: --load-format dummy); TINY for the CPU dry run.
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
            "vocab_size": 128256, "tie_word_embeddings": True, "rope_theta": 500000.0,
            "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 8000,
        "tie_word_embeddings": True, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "torch_dtype": "float32"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def model_dir(ctx: Ctx) -> Path:
    """The step model's directory (config.json + the tiny model's tokenizer, no weights).

    Token ids of the tiny tokenizer (< 8000) are valid in the 1B vocabulary.
    """
    import shutil

    from ringserve.gpu.testing import tiny_model

    path = ctx.scratch / ("tiny-dummy" if ctx.dry else "llama-3.2-1b-shaped")
    if (path / "config.json").exists():
        return path
    tmp = Path(tempfile.mkdtemp(dir=ctx.scratch))
    tiny = tiny_model("llama")
    for name in TOKENIZER_FILES:
        if (tiny / name).exists():
            shutil.copy(tiny / name, tmp / name)
    ids = json.loads((tiny / "config.json").read_text())
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_bias": False,
              "mlp_bias": False, "initializer_range": 0.02,
              **{k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in ids},
              **(TINY if ctx.dry else LLAMA_1B)}
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    with contextlib.suppress(OSError):
        tmp.rename(path)
    return path


def param_count(cfg: dict[str, Any]) -> int:
    """Parameters of a Llama config (tied embeddings counted once)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    dim = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * dim, cfg["num_key_value_heads"] * dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    embed = cfg["vocab_size"] * h * (1 if cfg["tie_word_embeddings"] else 2)
    return layers * per_layer + embed + h


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    import torch

    size = (1 << 30) if device == "cuda" else (128 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    reps = 10 if device == "cuda" else 3
    dst.copy_(src)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * size * reps / (time.perf_counter() - start)


def llm_args(ctx: Ctx, **extra: Any) -> dict[str, Any]:
    """ringserve.LLM arguments for the step model on the step's device."""
    args: dict[str, Any] = {"device": ctx.device, "load_format": "dummy",
                            "dtype": "float32" if ctx.dry else "bfloat16",
                            "disable_log_stats": True, "max_model_len": 2048}
    if ctx.dry:
        args["kv_cache_memory"] = 64 << 20
    return {**args, **extra}


# -- step: pytest -m gpu ----------------------------------------------------------------------


def step_pytest_gpu(ctx: Ctx) -> dict[str, Any]:
    """`pytest -m gpu` over tests/; a module that cannot be collected is named, not fatal."""
    import torch

    budget = ctx.budget_s - 10  # room to report what finished before the step's own limit
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu and not long", "-v", "-p",
           "no:cacheprovider", "--continue-on-collection-errors", "tests"]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget)
        out, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or "")
        code = 124
    print(out)
    outcomes = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", out, re.M)
    counts: dict[str, int] = {}
    for _test, outcome in outcomes:
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    errors = re.findall(r"^ERROR (\S+)", out, re.M)
    figures = {"counts": counts, "exit_status": code,
               "failed": [t for t, o in outcomes if o in ("FAILED", "ERROR")],
               "collection_errors": errors}
    if code == 124:
        raise RuntimeError(f"pytest ran past {budget:.0f} s; finished so far: {counts}")
    if code == 5 or not outcomes:
        raise RuntimeError(f"no test marked gpu was collected (exit {code}):\n{_tail(out)}")
    if code != 0:
        raise StepFailed(f"pytest exit {code}: {figures['failed'][:10]} "
                         f"{errors[:5]}", figures)
    if not torch.cuda.is_available():
        raise SkipWith(f"no CUDA: the {counts.get('skipped', 0)} tests marked gpu were "
                       "collected and skipped", figures)
    return figures


class StepFailed(Exception):
    """A step that ran and failed, with the figures it measured."""

    def __init__(self, message: str, figures: dict[str, Any]) -> None:
        super().__init__(message)
        self.figures = figures


class SkipWith(Skip):
    """A skip that still reports what was measured."""

    def __init__(self, message: str, figures: dict[str, Any]) -> None:
        super().__init__(message)
        self.figures = figures


# -- step: Triton kernels vs the torch reference ----------------------------------------------


def _attention_case(device: str, dtype: Any, heads: int, kv_heads: int, dim: int,
                    block_size: int, ctx_lens: list[int], new_lens: list[int],
                    seed: int) -> dict[str, float]:
    """KV write and paged attention, Triton vs torch reference (in float32), on one batch."""
    import torch

    from ringserve.gpu.attention import torch_ref, triton_kernels
    from ringserve.gpu.attention.metadata import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, new_lens, strict=True)]
    per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_req) + 1
    order = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, as in serving
    table = torch.zeros(len(seq_lens), max(per_req), dtype=torch.int32)
    slots: list[int] = []
    token_req: list[int] = []
    used = 0
    for i, (c, n) in enumerate(zip(ctx_lens, new_lens, strict=True)):
        row = order[used:used + per_req[i]]
        used += per_req[i]
        table[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
        slots += [row[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        token_req += [i] * n
    qsl = [0]
    for n in new_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        token_to_req=torch.tensor(token_req, dtype=torch.int32, device=device),
        max_query_len=max(new_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens)
    torch.manual_seed(seed)
    total = qsl[-1]
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, device=device, dtype=dtype)
    key, value = (torch.randn(total, kv_heads, dim, device=device, dtype=dtype) for _ in "kv")
    query = torch.randn(total, heads, dim, device=device, dtype=dtype)
    ref_cache, tri_cache = cache, cache.clone()
    del cache
    torch_ref.write_kv(key, value, ref_cache, meta.slot_mapping)
    triton_kernels.write_kv(key, value, tri_cache, meta.slot_mapping)
    write_ok = bool(torch.equal(ref_cache, tri_cache))
    got = triton_kernels.paged_attention(query, tri_cache, meta, dim**-0.5)
    del tri_cache
    ref = torch_ref.paged_attention(query.float(), ref_cache.float(), meta, dim**-0.5)
    err = (ref - got.float()).abs().max().item()
    return {"kv_write_exact": write_ok, "attention_max_err": err}


def _attention_cases(dry: bool) -> list[tuple[str, dict[str, Any]]]:
    """(label, _attention_case arguments) for the serving shapes, or two tiny interpreter ones."""
    import random

    if dry:
        return [(f"d16 bs{bs} gqa4:2 mixed", {"heads": 4, "kv_heads": 2, "dim": 16,
                                              "block_size": bs, "ctx_lens": [20, 5],
                                              "new_lens": [1, 7], "seed": bs})
                for bs in (16, 32)]
    rng = random.Random(0)
    batches = {
        "decode B=1 ctx 8191": ([8191], [1]),
        "decode B=64 ctx 0..8191": ([rng.randrange(8192) for _ in range(64)], [1] * 64),
        "decode B=256 ctx 0..8191": ([rng.randrange(8192) for _ in range(256)], [1] * 256),
        "mixed 4 chunks of 512 + 124 decodes": (
            [rng.randrange(4096) for _ in range(128)], [512] * 4 + [1] * 124),
    }
    return [(f"d{dim} bs{bs} gqa32:8 {label}",
             {"heads": 32, "kv_heads": 8, "dim": dim, "block_size": bs, "ctx_lens": c,
              "new_lens": n, "seed": i})
            for dim in (64, 128) for bs in (16, 32)
            for i, (label, (c, n)) in enumerate(batches.items())]


def _moe_case(device: str, dtype: Any, tokens: int, experts: int, hidden: int, inter: int,
              top_k: int, blocks: tuple[int, int, int]) -> float:
    """Fused MoE vs the grouped oracle (float32 on CPU): max error over the oracle's max."""
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    from triton_moe_check import check_align, route

    from ringserve.gpu.moe.grouped import fused_experts
    from ringserve.gpu.moe.triton_moe import fused_moe

    torch.manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device) * inter**-0.5).to(dtype)
    weights, ids = route(tokens, experts, top_k, device)
    check_align(ids, blocks[0], experts)
    ref = fused_experts(x.float().cpu(), w13.float().cpu(), w2.float().cpu(),
                        weights.float().cpu(), ids.cpu())
    got = fused_moe(x, w13, w2, weights.to(dtype), ids, block_m=blocks[0], block_n=blocks[1],
                    block_k=blocks[2])
    return float((got.float().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def step_kernels(ctx: Ctx) -> dict[str, Any]:
    """Every Triton kernel against its torch reference; all cases run, failures listed."""
    import torch

    if not ctx.dry and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    attn_tol = 1e-4 if ctx.dry else 2e-2
    moe_tol = 1e-4 if ctx.dry else 2e-2
    figures: dict[str, Any] = {"dtype": str(dtype), "interpreter": ctx.dry, "attention": {},
                               "moe": {}}
    bad: list[str] = []
    for label, case in _attention_cases(ctx.dry):
        start = time.perf_counter()
        got = _attention_case(ctx.device, dtype, **case)
        got["seconds"] = round(time.perf_counter() - start, 2)
        figures["attention"][label] = got
        print(label, got, flush=True)
        if not got["kv_write_exact"] or got["attention_max_err"] > attn_tol:
            bad.append(f"{label}: {got}")
        if ctx.device == "cuda":
            torch.cuda.empty_cache()
    # (T, E, H, I, top_k, blocks): Qwen3-30B-A3B's expert shape at decode and prefill batches.
    moe_cases = ([(5, 6, 48, 40, 2, (16, 32, 32))] if ctx.dry else
                 [(1, 128, 2048, 768, 8, (16, 64, 32)), (64, 128, 2048, 768, 8, (16, 64, 32)),
                  (256, 128, 2048, 768, 8, (64, 64, 32))])
    for tokens, experts, hidden, inter, top_k, blocks in moe_cases:
        label = f"T={tokens} E={experts} H={hidden} I={inter} top{top_k} {blocks}"
        err = _moe_case(ctx.device, dtype, tokens, experts, hidden, inter, top_k, blocks)
        figures["moe"][label] = {"rel_max_err": err}
        print(label, err, flush=True)
        if err > moe_tol:
            bad.append(f"MoE {label}: relative error {err:.3g}")
    figures["tolerance"] = {"attention_abs": attn_tol, "moe_rel": moe_tol}
    if bad:
        raise StepFailed("; ".join(bad), figures)
    return figures


# -- step: decode step time against the roofline ---------------------------------------------


def step_decode(ctx: Ctx) -> dict[str, Any]:
    """Decode step time per batch size, against (weight + mean KV bytes per step) / the copy
    bandwidth measured here. A step's time is read off the requests' own token timestamps:
    (last token - first token) / (tokens - 1), the median over the batch, so prefill is out."""
    import random
    import statistics

    from ringserve import LLM, SamplingParams

    path = model_dir(ctx)
    cfg = json.loads((path / "config.json").read_text())
    batches, prompt_len, steps = ((1, 4), 16, 16) if ctx.dry else ((1, 8, 64, 256), 128, 64)
    elem = 4 if ctx.dry else 2
    bandwidth = copy_bandwidth(ctx.device)
    weight_bytes = param_count(cfg) * elem
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * elem
    rng = random.Random(0)
    rows: dict[str, Any] = {}
    with LLM(str(path), **llm_args(ctx, max_num_seqs=max(batches),
                                   enable_prefix_caching=False)) as llm:
        def step_seconds(batch: int, tokens: int) -> float:
            prompts = [{"prompt_token_ids": [rng.randrange(10, 8000) for _ in range(prompt_len)]}
                       for _ in range(batch)]
            params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
            spans = []
            for out in llm.generate(prompts, params, use_tqdm=False):
                m = out.metrics
                assert m is not None and m.first_token_time and m.last_token_time
                spans.append((m.last_token_time - m.first_token_time)
                             / max(m.num_generation_tokens - 1, 1))
            return statistics.median(spans)

        for batch in batches:
            step_seconds(batch, 4)  # warm-up: graphs, kernels, allocator
            step_s = min(step_seconds(batch, 1 + steps) for _ in range(2))
            kv_bytes = batch * (prompt_len + steps / 2) * kv_per_token
            roof_s = (weight_bytes + kv_bytes) / bandwidth
            rows[str(batch)] = {"step_ms": round(step_s * 1e3, 3),
                                "roofline_ms": round(roof_s * 1e3, 3),
                                "fraction_of_roofline": round(roof_s / step_s, 3),
                                "tok_per_s": round(batch / step_s, 1)}
            print(batch, rows[str(batch)], flush=True)
    return {"model": "tiny (dry run)" if ctx.dry else "Llama-3.2-1B shape, random bf16",
            "params": param_count(cfg), "weight_bytes": weight_bytes,
            "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "prompt_len": prompt_len,
            "timed_steps": steps, "batches": rows}


# -- step: offline throughput against transformers generate ----------------------------------


def step_throughput(ctx: Ctx) -> dict[str, Any]:
    """LLM.generate vs one left-padded transformers `generate`, same model shape and device."""
    import random

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ringserve import LLM, SamplingParams
    from ringserve.bench.throughput import check_counts

    path = model_dir(ctx)
    rng = random.Random(0)
    n, lo, hi, olo, ohi = (4, 8, 16, 4, 8) if ctx.dry else (64, 128, 512, 64, 256)
    prompts = [[rng.randrange(10, 8000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outs = [rng.randint(olo, ohi) for _ in range(n)]
    figures: dict[str, Any] = {"requests": n, "output_tokens": sum(outs)}
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outs]
    with LLM(str(path), **llm_args(ctx)) as llm:
        llm.generate([{"prompt_token_ids": prompts[0]}], params[0], use_tqdm=False)
        start = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    credited, problems = check_counts("ringserve", [len(r.outputs[0].token_ids) for r in results],
                                      outs)
    figures["ringserve"] = {"seconds": round(seconds, 3), "tok_per_s": round(credited / seconds, 1)}
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    with torch.device(ctx.device):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype).eval()
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=ctx.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts],
                        device=ctx.device)
    with torch.no_grad():
        hf.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=4, do_sample=False,
                    pad_token_id=0)
        if ctx.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        seqs = hf.generate(ids, attention_mask=mask, max_new_tokens=max(outs), do_sample=False,
                           min_new_tokens=max(outs), eos_token_id=None, pad_token_id=0)
        if ctx.device == "cuda":
            torch.cuda.synchronize()
        hf_seconds = time.perf_counter() - start
    hf_credited, hf_problems = check_counts(
        "transformers", [int(seqs.shape[1]) - longest] * n, outs, at_least=True)
    figures["transformers_generate"] = {"seconds": round(hf_seconds, 3),
                                        "tok_per_s": round(hf_credited / hf_seconds, 1)}
    figures["ratio"] = round(figures["ringserve"]["tok_per_s"]
                             / figures["transformers_generate"]["tok_per_s"], 2)
    if problems or hf_problems:
        raise StepFailed("token count mismatch: " + "; ".join((problems + hf_problems)[:5]),
                         figures)
    return figures


# -- steps with a live server: bench serve, chaos ---------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def live_server(model: Path, flags: list[str], log: Path,
                ready_s: float = 120.0) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`ringserve serve` on a free port, in the step's process group (so a timeout's killpg
    takes it); yields (base URL, process) once /health answers 200, killed on exit."""
    import urllib.error
    import urllib.request

    port = _free_port()
    cmd = [sys.executable, "-m", "ringserve.cli", "serve", str(model), "--port", str(port),
           "--served-model-name", "m", *flags]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}:\n"
                                   f"{_tail(log.read_text(errors='replace'), 30)}")
            with contextlib.suppress(urllib.error.URLError, OSError), \
                    urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                if resp.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in {ready_s:.0f} s:\n"
                                   f"{_tail(log.read_text(errors='replace'), 30)}")
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(_tail(log.read_text(errors="replace"), 20))


def device_flags(ctx: Ctx) -> list[str]:
    """`ringserve serve` flags for the step's device."""
    if ctx.dry:
        return ["--device", "cpu", "--kv-cache-memory", "64MiB", "--max-model-len", "512"]
    return ["--device", "cuda", "--max-model-len", "2048"]


def step_serve(ctx: Ctx) -> dict[str, Any]:
    """`ringserve bench serve` with every request in flight at once (256 on the GPU)."""
    path = model_dir(ctx)
    concurrency, prompts, inp, outp = (4, 4, 16, 8) if ctx.dry else (256, 512, 256, 128)
    flags = [*device_flags(ctx), "--load-format", "dummy", "--disable-log-stats",
             "--max-num-seqs", str(concurrency),
             "--dtype", "float32" if ctx.dry else "bfloat16"]
    result = ctx.scratch / "serve_result.json"
    with live_server(path, flags, ctx.scratch / "serve.log") as (url, _proc):
        cmd = [sys.executable, "-m", "ringserve.cli", "bench", "serve", "--base-url", url,
               "--model", str(path), "--served-model-name", "m", "--num-prompts", str(prompts),
               "--max-concurrency", str(concurrency), "--random-input-len", str(inp),
               "--random-output-len", str(outp), "--ignore-eos", "--seed", "0",
               "--save-result", "--result-dir", str(ctx.scratch),
               "--result-filename", result.name]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        print(done.stdout, done.stderr)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"bench serve exited {done.returncode}: {_tail(done.stderr)}")
    got = json.loads(result.read_text())
    keys = ("completed", "failed", "duration", "request_throughput", "output_throughput",
            "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
            "token_count_mismatches")
    figures = {"concurrency": concurrency, "num_prompts": prompts, "input_len": inp,
               "output_len": outp, **{k: got[k] for k in keys if k in got}}
    if got.get("failed") or got.get("completed") != prompts:
        raise StepFailed(f"{got.get('failed')} of {prompts} requests failed", figures)
    return figures


def _descendants(pid: int, title: str) -> list[int]:
    """Processes under `pid` whose command line starts with `title`."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for path in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                for kid in (int(k) for k in path.read_text().split()):
                    todo.append(kid)
                    with contextlib.suppress(OSError):
                        name = Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")[0]
                        if name.decode(errors="replace").startswith(title):
                            found.append(kid)
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] not in (b"Z", b"X")


async def _chaos_rounds(url: str, server_pid: int, rounds: int, admin: str) -> dict[str, Any]:
    """The suite's worker-kill case: streams in flight, SIGKILL the worker, every stream ends,
    retry, healthy, greedy text equal to the fault-free run's, the old worker gone."""
    import httpx
    import trio

    auth = {"Authorization": f"Bearer {admin}"}
    prompts = [f"chaos prompt number {i}" for i in range(8)]

    async def greedy(client: httpx.AsyncClient) -> list[str]:
        texts = [""] * len(prompts)

        async def one(i: int) -> None:
            body = {"model": "m", "prompt": prompts[i], "max_tokens": 16, "temperature": 0.0,
                    "ignore_eos": True}
            resp = await client.post("/v1/completions", json=body)
            resp.raise_for_status()
            texts[i] = resp.json()["choices"][0]["text"]

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        return texts

    async def status(client: httpx.AsyncClient) -> dict[str, Any]:
        resp = await client.get("/fault_tolerance/status", headers=auth)
        resp.raise_for_status()
        engine: dict[str, Any] = resp.json()["engines"][0]
        return engine

    async def wait_status(client: httpx.AsyncClient, wanted: str, timeout: float
                          ) -> dict[str, Any]:
        with trio.fail_after(timeout):
            while (engine := await status(client))["status"] != wanted:
                await trio.sleep(0.05)
        return engine

    timings: list[dict[str, float]] = []
    ends = {"errored": 0, "finished": 0}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        baseline = await greedy(client)
        for _ in range(rounds):
            workers = _descendants(server_pid, "ringserve::Worker_TP")
            if len(workers) != 1:
                raise RuntimeError(f"expected one worker under the server, found {workers}")
            started = [trio.Event() for _ in range(8)]
            last_end = 0.0

            async def stream(ready: trio.Event) -> None:
                nonlocal last_end
                body = {"model": "m", "prompt": "hello world", "max_tokens": 400,
                        "stream": True, "ignore_eos": True, "temperature": 0.0}
                events: list[str] = []
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 2:
                                ready.set()
                last_end = time.monotonic()
                if events[-1] != "[DONE]":
                    raise RuntimeError(f"a stream ended without [DONE]: {events[-3:]}")
                ends["errored" if "error" in json.loads(events[-2]) else "finished"] += 1

            async with trio.open_nursery() as nursery:
                for event in started:
                    nursery.start_soon(stream, event)
                with trio.fail_after(120):
                    for event in started:
                        await event.wait()
                os.kill(workers[0], signal.SIGKILL)
                killed = time.monotonic()
            detect = last_end - killed
            engine = await wait_status(client, "unhealthy", 10)
            if "WorkerDied" not in (engine["fault_info"] or ""):
                raise RuntimeError(f"fault not reported as a worker death: {engine}")
            start = time.monotonic()
            resp = await client.post("/fault_tolerance/apply", headers=auth,
                                     json={"instruction": "retry", "params": {}})
            if resp.status_code != 202:
                raise RuntimeError(f"retry answered {resp.status_code}: {resp.text}")
            await wait_status(client, "healthy", 120)
            recover = time.monotonic() - start
            if await greedy(client) != baseline:
                raise RuntimeError("greedy output after the retry differs from the baseline")
            if _alive(workers[0]):
                raise RuntimeError(f"the killed worker {workers[0]} is still alive")
            timings.append({"streams_ended_s": round(detect, 3), "recover_s": round(recover, 3)})
    return {"rounds": rounds, "timings": timings, "streams": ends}


def step_chaos(ctx: Ctx) -> dict[str, Any]:
    """The chaos suite's worker kill with TP=1 on this device.

    tests/chaos/test_chaos.py cannot target a GPU (its flags fix TP=2 and `--device cpu`), so
    this step runs its worker-kill case itself against a `ringserve serve` with one mp worker.
    """
    import trio

    from ringserve.gpu.testing import tiny_model

    admin = "gpu-check-admin"
    flags = [*device_flags(ctx), "--distributed-executor-backend", "mp",
             "--tensor-parallel-size", "1", "--admin-api-key", admin, "--disable-log-stats",
             "--engine-recovery-timeout-sec", "120"]
    with live_server(tiny_model("llama"), flags, ctx.scratch / "chaos.log") as (url, proc):
        return trio.run(_chaos_rounds, url, proc.pid, 1 if ctx.dry else 2, admin)


STEP_FUNCS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "pytest_gpu": step_pytest_gpu, "kernels": step_kernels, "decode": step_decode,
    "throughput": step_throughput, "serve": step_serve, "chaos": step_chaos,
}


def run_step(name: str, ctx: Ctx, result: Path) -> int:
    """Run one step in this process and write its result file; the exit status."""
    entry: dict[str, Any] = {"status": "ok", "figures": {}}
    code = 0
    try:
        entry["figures"] = STEP_FUNCS[name](ctx)
    except Skip as exc:
        entry.update(status="skipped", reason=str(exc), figures=getattr(exc, "figures", {}))
    except BaseException as exc:
        traceback.print_exc()
        entry.update(status="failed", error=f"{type(exc).__name__}: {exc}",
                     figures=getattr(exc, "figures", {}))
        code = 1
    result.write_text(json.dumps(entry, indent=1, default=str))
    return code


def main(argv: list[str]) -> int:
    """Run the check (or, with --step, one step in this process)."""
    parser = argparse.ArgumentParser(prog="scripts/gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="every step on CPU at tiny sizes (no GPU needed)")
    parser.add_argument("--out", type=Path, help="summary and log folder (default: $OUT, "
                        "else a new temporary folder)")
    parser.add_argument("--only", help="comma-separated steps to run (the install always runs)")
    parser.add_argument("--step", choices=sorted(STEP_FUNCS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=0.0, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.step:
        ctx = Ctx(dry=ns.cpu_dry_run, scratch=ns.scratch, budget_s=ns.budget)
        return run_step(ns.step, ctx, ns.result)
    out = ns.out or (Path(os.environ["OUT"]) if os.environ.get("OUT")
                     else Path(tempfile.mkdtemp(prefix="gpu-check-out-")))
    only = ns.only.split(",") if ns.only else None
    if only and (unknown := set(only) - set(STEP_FUNCS)):
        parser.error(f"unknown steps {sorted(unknown)}; known: {', '.join(STEP_FUNCS)}")
    summary = orchestrate(ns.cpu_dry_run, out, only)
    print(json.dumps({s["name"]: s["status"] for s in summary["steps"]}))
    print(f"summary: {out / 'gpu_check.json'}  log: {summary['log']}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
