"""The Triton fused MoE (`ringserve.gpu.moe.triton_moe`) against the grouped torch oracle: the
block alignment in-process (torch only), the kernel under the Triton interpreter on CPU (in a
subprocess, because TRITON_INTERPRET must be set before the kernel is defined) and natively on
CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_moe_check import check_align

from ringserve.gpu.moe.triton_moe import fused_moe

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("tokens", [0, 1, 5, 33])
@pytest.mark.parametrize("block_size", [16, 64])
def test_align_pairs_once_padded_one_expert_per_block(tokens: int, block_size: int) -> None:
    torch.manual_seed(tokens)
    # Expert 5 of 6 gets no token.
    ids = torch.rand(tokens, 5).topk(2, dim=-1).indices
    check_align(ids, block_size, num_experts=6)


def test_no_tokens_is_an_empty_output_without_a_launch() -> None:
    x = torch.empty(0, 32)
    out = fused_moe(x, torch.zeros(4, 32, 32), torch.zeros(4, 32, 16),
                    torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int64))
    assert out.shape == (0, 32)


@pytest.mark.parametrize(("w13_shape", "w2_shape", "blocks", "message"), [
    ((4, 32, 32), (4, 32, 16), (16, 32, 24), "block_k must be a power of two >= 16"),
    ((4, 32, 32), (4, 32, 16), (8, 32, 32), "block_m must be a power of two >= 16"),
    ((4, 32, 48), (4, 32, 16), (16, 32, 32), "w13 must be"),
    ((4, 32, 32), (4, 32, 8), (16, 32, 32), "w13 must be"),
])
def test_bad_shapes_and_blocks_are_named(w13_shape: tuple[int, ...], w2_shape: tuple[int, ...],
                                         blocks: tuple[int, int, int], message: str) -> None:
    x = torch.zeros(3, 32)
    with pytest.raises(ValueError, match=message):
        fused_moe(x, torch.zeros(w13_shape), torch.zeros(w2_shape), torch.ones(3, 2),
                  torch.zeros(3, 2, dtype=torch.int64),
                  block_m=blocks[0], block_n=blocks[1], block_k=blocks[2])


@pytest.mark.slow
def test_fused_moe_matches_grouped_oracle_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "import torch, triton_moe_check; torch.set_num_threads(2); triton_moe_check.check('cpu')"
    done = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
def test_fused_moe_matches_grouped_oracle_on_cuda() -> None:
    import triton_moe_check

    cases = triton_moe_check.CUDA_CASES
    triton_moe_check.check("cuda", torch.float32, atol=1e-4, cases=cases)
    triton_moe_check.check("cuda", torch.bfloat16, atol=5e-2, cases=cases)
    triton_moe_check.check("cuda", torch.float16, atol=2e-2, cases=cases)
