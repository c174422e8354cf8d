"""Triton kernels vs the torch reference on small mixed batches (prefill chunk + decodes,
GQA, partial last pages). Imported by test_gpu_triton.py: in a TRITON_INTERPRET=1 subprocess
on CPU, and in-process on CUDA."""

from __future__ import annotations

import torch

from ringserve.gpu.attention import torch_ref, triton_kernels
from ringserve.gpu.attention.metadata import AttentionMetadata


def check(device: str = "cpu", dtype: torch.dtype = torch.float32, atol: float = 1e-5) -> None:
    torch.manual_seed(0)
    block_size, kv_heads, heads, dim, num_blocks = 4, 2, 4, 16, 16
    # request 0: 5 cached + 3 new (prefill chunk); request 1: decode at position 6; request 2: fresh 2
    ctx, new = [5, 6, 0], [3, 1, 2]
    tables = [[3, 7, 1], [2, 9], [11]]
    seq_lens = [c + n for c, n in zip(ctx, new, strict=True)]
    qsl = [0, 3, 4, 6]
    total = qsl[-1]
    slots, token_req = [], []
    for i, (c, n) in enumerate(zip(ctx, new, strict=True)):
        for p in range(c, c + n):
            slots.append(tables[i][p // block_size] * block_size + p % block_size)
            token_req.append(i)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, device=device).to(dtype)
    bt = torch.zeros(3, 3, dtype=torch.int32)
    for i, row in enumerate(tables):
        bt[i, : len(row)] = torch.tensor(row)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=bt.to(device), token_to_req=torch.tensor(token_req, dtype=torch.int32, device=device),
        max_query_len=max(new), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    key = torch.randn(total, kv_heads, dim, device=device).to(dtype)
    value = torch.randn(total, kv_heads, dim, device=device).to(dtype)
    query = torch.randn(total, heads, dim, device=device).to(dtype)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    torch_ref.write_kv(key, value, ref_cache, meta.slot_mapping)
    triton_kernels.write_kv(key, value, tri_cache, meta.slot_mapping)
    assert torch.equal(ref_cache, tri_cache), "KV write differs"
    ref = torch_ref.paged_attention(query, ref_cache, meta, dim**-0.5)
    got = triton_kernels.paged_attention(query, tri_cache, meta, dim**-0.5)
    err = (ref.float() - got.float()).abs().max().item()
    assert err < atol, f"paged attention differs by {err}"


def check_model(model_dir: str, device: str = "cpu") -> None:
    """Greedy tokens of a tiny model are the same with the Triton and the torch backends."""
    from pathlib import Path

    from gpu_helpers import make_runner
    from runner_driver import ToyScheduler

    from ringserve.sampling_params import SamplingParams

    outputs = []
    for backend in ("torch", "triton"):
        runner = make_runner(Path(model_dir), backend=backend, device=device)  # type: ignore[arg-type]
        sched = ToyScheduler(runner, budget=8)
        for i, n in enumerate((10, 3)):
            sched.add(f"r{i}", list(range(40 + i, 40 + i + n)), SamplingParams(temperature=0.0), 2)
        outputs.append(sched.run())
    assert outputs[0] == outputs[1], outputs
