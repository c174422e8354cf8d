"""The verify step's layout (each draft position a one-token query) gives the logits of
single-token decodes: with the torch backend in process, and with the Triton kernels under
the interpreter on CPU (issue 41, item 5: the path written for the GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_verify_layout_matches_decodes_torch_backend(tiny_llama_dir: Path) -> None:
    sys.path.insert(0, str(HERE))
    import verify_check

    verify_check.check(str(tiny_llama_dir), "torch")


@pytest.mark.slow
def test_verify_layout_matches_decodes_triton_under_interpreter(tiny_llama_dir: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = ("import torch, verify_check; torch.set_num_threads(2); "
            f"verify_check.check({str(tiny_llama_dir)!r}, 'triton')")
    done = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
