"""Triton KV-write and paged-attention kernels against the torch reference: under the Triton
interpreter on CPU (in a subprocess, because TRITON_INTERPRET must be set before the kernels
are defined), and natively on CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_triton_kernels_match_reference_under_interpreter(tiny_llama_dir: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = (
        "import torch, triton_check; torch.set_num_threads(2); triton_check.check('cpu'); "
        f"triton_check.check_model({str(tiny_llama_dir)!r})"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
def test_triton_kernels_match_reference_on_cuda() -> None:
    import torch
    import triton_check

    triton_check.check("cuda", torch.float32, atol=1e-4)
    triton_check.check("cuda", torch.bfloat16, atol=2e-2)


@pytest.mark.gpu
def test_triton_backend_model_matches_torch_backend_on_cuda(tiny_llama_dir: Path) -> None:
    import triton_check

    triton_check.check_model(str(tiny_llama_dir), device="cuda")
