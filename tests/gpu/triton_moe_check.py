"""The Triton fused MoE against the grouped torch oracle (`grouped.fused_experts`) and the
invariants of its block alignment. Imported by test_triton_moe.py: in a TRITON_INTERPRET=1
subprocess on CPU (the kernel must be defined with the variable set), and in-process on CUDA
and for the alignment alone (torch only)."""

from __future__ import annotations

import torch

from ringserve.gpu.moe.grouped import fused_experts
from ringserve.gpu.moe.triton_moe import fused_moe, moe_align_block_size

# (T, E, H, I, blocks): H and I off the block sizes (H 40 and 48 against block_k / block_n 32,
# 2I = 80, I = 24 as the down GEMM's K), T = 1 and 33 off block_m.
INTERPRETER_CASES: list[tuple[int, int, int, int, tuple[int, int, int]]] = [
    (1, 4, 32, 16, (16, 32, 32)),
    (5, 6, 48, 40, (16, 32, 32)),
    (33, 8, 40, 24, (16, 16, 16)),
]
CUDA_CASES: list[tuple[int, int, int, int, tuple[int, int, int]]] = [
    *INTERPRETER_CASES,
    (300, 16, 256, 176, (16, 32, 32)),
    (257, 8, 320, 200, (64, 64, 32)),
]


def route(tokens: int, num_experts: int, top_k: int, device: str
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, drawn from all but the last expert (which gets no token)."""
    scores = torch.rand(tokens, num_experts - 1, device=device)
    weights, ids = scores.topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def check_align(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> None:
    """Every pair exactly once, in expert order; runs padded with the sentinel; one expert a block."""
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, block_size, num_experts)
    flat = topk_ids.reshape(-1).cpu()
    sentinel = flat.numel()
    sorted_ids, expert_ids = sorted_ids.cpu().long(), expert_ids.cpu().long()
    used = int(num_post.item())
    assert used % block_size == 0 and sorted_ids.numel() % block_size == 0
    assert expert_ids.numel() == sorted_ids.numel() // block_size
    assert bool((sorted_ids[used:] == sentinel).all()), "past the end is not the sentinel"
    assert bool((expert_ids[used // block_size:] == -1).all()), "blocks past the end have experts"
    real = sorted_ids[sorted_ids != sentinel]
    assert torch.equal(real.sort().values, torch.arange(sentinel)), "pairs missing or repeated"
    assert torch.equal(real, torch.argsort(flat, stable=True)), "pairs not in expert order"
    counts = torch.bincount(flat, minlength=num_experts)
    blocks = sorted_ids[:used].view(-1, block_size)
    block_experts = expert_ids[: used // block_size]
    want = torch.repeat_interleave(torch.arange(num_experts), (counts + block_size - 1) // block_size)
    assert torch.equal(block_experts, want), "wrong number of blocks per expert"
    for block, expert in zip(blocks, block_experts.tolist(), strict=True):
        pairs = block[block != sentinel]
        assert bool((flat[pairs] == expert).all()), "a block mixes experts"
        assert bool((block[: pairs.numel()] == pairs).all()), "padding before pairs in a block"


def check(device: str = "cpu", dtype: torch.dtype = torch.float32, atol: float = 1e-5,
          cases: list[tuple[int, int, int, int, tuple[int, int, int]]] | None = None) -> None:
    """fused_moe == fused_experts (on the same values in float32, on CPU) within `atol`."""
    torch.manual_seed(0)
    top_k = 2
    for tokens, num_experts, hidden, inter, blocks in cases or INTERPRETER_CASES:
        x = torch.randn(tokens, hidden, device=device)
        w13 = torch.randn(num_experts, 2 * inter, hidden, device=device) * hidden**-0.5
        w2 = torch.randn(num_experts, hidden, inter, device=device) * inter**-0.5
        weights, ids = route(tokens, num_experts, top_k, device)
        x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
        check_align(ids, blocks[0], num_experts)
        # The oracle runs on CPU in float32 whatever the device (no TF32, no CUDA grouped-mm
        # dtype limits).
        ref = fused_experts(x.float().cpu(), w13.float().cpu(), w2.float().cpu(),
                            weights.float().cpu(), ids.cpu())
        got = fused_moe(x, w13, w2, weights, ids,
                        block_m=blocks[0], block_n=blocks[1], block_k=blocks[2])
        assert got.dtype == dtype and got.shape == (tokens, hidden)
        err = (got.float().cpu() - ref).abs().max().item()
        assert err < atol, f"T={tokens} E={num_experts} H={hidden} I={inter} {blocks}: {err}"
