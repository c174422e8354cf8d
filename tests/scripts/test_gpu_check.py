"""scripts/gpu_wheels' plan (what is shipped, pinned to what, and what is skipped and why) on
fake metadata and on .venv's, the check's step guard (a hung step's whole process group is
killed at its budget), and (slow) `scripts/gpu_check --cpu-dry-run` end to end."""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load(name: str, filename: str) -> ModuleType:
    loader = importlib.machinery.SourceFileLoader(name, str(SCRIPTS / filename))
    spec = importlib.util.spec_from_loader(name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def wheels() -> ModuleType:
    return _load("gpu_wheels", "gpu_wheels")


@pytest.fixture(scope="module")
def check() -> ModuleType:
    return _load("gpu_check", "gpu_check.py")


REQUIRES = {
    "torch": ["filelock", "sympy>=1", "nvidia-cublas; platform_system == 'Linux'"],
    "triton": [],
    "transformers": ["numpy>=1.17", "huggingface-hub", "kernels", "pydantic"],
    "huggingface-hub": ["httpx2", "filelock"],
    "numpy": [], "sympy": ["mpmath"], "mpmath": [], "filelock": [], "nvidia-cublas": [],
    "kernels": [], "httpx2": [], "pydantic": [],
    # A requirement only for Python < 3.11 is not followed; one only for >= 3.12 is, whatever
    # the interpreter running the plan: the target is CPython 3.12.
    "trio": ["sniffio", "exceptiongroup; python_version < '3.11'",
             "only312; python_version >= '3.12'"],
    "sniffio": [], "only312": [],
    "httpx": ["h2; extra == 'http2'", "anyio", "brotli; extra == 'brotli'"],
    "h2": ["hpack"], "hpack": [], "anyio": [],
    "openai": ["pydantic", "anyio"],
    "ray": ["msgpack", "filelock"], "msgpack": [],
    "mypy": ["mypy-extensions"], "mypy-extensions": [],
    "pytest-trio": ["trio", "pytest"], "pytest": [],
}
VERSIONS = {name: f"1.{i}" for i, name in enumerate(REQUIRES)}
PROJECT = ["torch==2.13.0", "triton>=3.0", "transformers>=4.50", "trio>=0.27", "numpy>=1.26",
           "huggingface_hub>=0.30", "ray>=2.40", "httpx[http2]>=0.27", "openai>=1.50",
           "mypy>=1.13", "pytest-trio>=0.8", "pytest>=8", "winonly; sys_platform == 'win32'"]
IMAGE = ["numpy", "filelock", "sympy", "mpmath", "huggingface-hub", "anyio", "pytest",
         "nvidia-cublas", "torch", "triton", "transformers"]


def test_plan_ships_the_rest_pinned_and_says_why_each_skip(wheels: ModuleType) -> None:
    plan = wheels.make_plan(PROJECT, ("torch", "triton", "transformers"), ("ray", "mypy"),
                            REQUIRES, VERSIONS, image=IMAGE)
    assert plan.missing == []
    # pydantic: transformers' too, but not on the image and openai needs it; pytest and
    # anyio are on the image but no provided package needs them, so the pins win.
    assert set(plan.keep) == {"trio", "sniffio", "only312", "httpx", "h2", "hpack", "anyio",
                              "openai", "pydantic", "pytest-trio", "pytest"}
    assert all(plan.keep[name] == VERSIONS[name] for name in plan.keep)
    why = plan.skipped
    assert {why[n] for n in ("torch", "triton", "transformers")} == {"provided on the GPU machine"}
    for name in ("numpy", "filelock", "sympy", "mpmath", "huggingface-hub", "nvidia-cublas"):
        assert why[name].startswith("on the GPU image (needed by "), (name, why[name])
    assert why["filelock"] == "on the GPU image (needed by torch, transformers)"
    assert why["sympy"] == "on the GPU image (needed by torch)"
    # What only .venv's transformers stack needs is left to the image's own versions.
    assert why["kernels"].startswith("needed only by .venv's transformers")
    assert why["httpx2"].startswith("needed only by .venv's transformers")
    assert why["ray"] == why["mypy"] == "not needed by gpu_check"
    assert why["msgpack"] == "needed only by ray"
    assert why["mypy-extensions"] == "needed only by mypy"
    assert not {"exceptiongroup", "brotli", "winonly"} & (set(plan.keep) | set(why))


def test_plan_names_requirements_it_cannot_pin(wheels: ModuleType) -> None:
    plan = wheels.make_plan([*PROJECT, "absent>=1"], ("torch",), (), REQUIRES, VERSIONS,
                            image=IMAGE)
    assert plan.missing == ["absent>=1"]


def test_plan_of_this_venv_skips_the_gpu_stack_and_pins_installed_versions(
        wheels: ModuleType) -> None:
    import importlib.metadata as md

    requires, versions, project = wheels.venv_metadata()
    plan = wheels.make_plan(project, wheels.PROVIDED, wheels.NOT_NEEDED, requires, versions)
    assert plan.missing == []
    for name in ("torch", "triton", "transformers", "ray", "mypy", "ruff", "numpy",
                 "tokenizers", "safetensors", "huggingface-hub"):
        assert name in plan.skipped and name not in plan.keep, name
    assert not any(name.startswith("nvidia-") for name in plan.keep)
    for name in ("trio", "pyzmq", "msgspec", "hypercorn", "xgrammar", "pytest", "pytest-trio"):
        assert plan.keep[name] == md.version(name), name


def test_a_hung_step_is_killed_with_its_process_group(check: ModuleType, tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    log = tmp_path / "log"
    script = f"sleep 60 & echo $! > {pid_file}; echo started; wait"
    start = time.monotonic()
    code, out = check._run_logged(["sh", "-c", script], log, dict(os.environ), timeout=1.0)
    assert code == 124 and time.monotonic() - start < 10
    assert "started" in out and "started" in log.read_text()
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while check._alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not check._alive(grandchild)


def test_param_count_is_llama_3_2_1b(check: ModuleType) -> None:
    # Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings).
    assert check.param_count(check.LLAMA_1B) == 1_235_814_400


@pytest.mark.slow
def test_cpu_dry_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen([str(SCRIPTS / "gpu_check"), "--cpu-dry-run", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=420)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    summary = json.loads((out / "gpu_check.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == ["install", "pytest_gpu", "kernels", "decode", "throughput", "serve",
                           "chaos"], stdout[-3000:]
    for step in steps.values():
        assert set(step) >= {"name", "status", "seconds", "figures", "error", "reason"}
        assert step["status"] in ("ok", "failed", "skipped")
        assert (step["error"] is not None) == (step["status"] == "failed"), step
        assert (step["reason"] is not None) == (step["status"] == "skipped"), step
    failed = {n: s["error"] for n, s in steps.items() if s["status"] == "failed"}
    assert not failed and summary["ok"] and proc.returncode == 0, (failed, stdout[-3000:])
    assert summary["mode"] == "cpu-dry-run"
    assert (out / "gpu_check.log").stat().st_size > 0
    # What the CPU can do ran; the GPU tests were collected and skipped, and say why.
    for name in ("kernels", "decode", "throughput", "serve", "chaos"):
        assert steps[name]["status"] == "ok", steps[name]
    pytest_gpu = steps["pytest_gpu"]
    assert pytest_gpu["status"] == "skipped" and "no CUDA" in pytest_gpu["reason"]
    assert pytest_gpu["figures"]["counts"].get("skipped", 0) > 0
    assert steps["install"]["status"] in ("ok", "skipped")  # skipped: no .whl here
    kernels = steps["kernels"]["figures"]
    assert kernels["interpreter"] and kernels["attention"] and kernels["moe"]
    batches = steps["decode"]["figures"]["batches"]
    assert set(batches) == {"1", "4"}
    assert all(row["step_ms"] > 0 and row["roofline_ms"] > 0 for row in batches.values())
    assert steps["throughput"]["figures"]["ratio"] > 0
    assert steps["serve"]["figures"]["completed"] == 4
    assert steps["chaos"]["figures"]["rounds"] == 1
