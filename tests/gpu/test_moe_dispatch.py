"""Expert-parallel dispatch over a gloo group of four ranks laid out as two engine cores of
TP=2 (the layout of `-dp 2 -tp 2 --enable-expert-parallel`): core 0's ranks route real tokens
(a prefill of 5, then a single decode token, fewer than the TP ranks), core 1's take part with
none (a dummy pass, as an idle data-parallel rank does); core 0 gets exactly what one process
holding every expert computes. Also the expert split and its error."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_helpers import free_port

from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.moe import grouped
from ringserve.gpu.moe.dispatch import EPGroup
from ringserve.gpu.moe.layer import FusedMoE
from ringserve.gpu.moe.router import select_experts

E, H, INTER, K = 8, 32, 24, 2


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(E, 2 * INTER, H, generator=gen) / 6,
            torch.randn(E, H, INTER, generator=gen) / 5)


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=gen)
    weights, ids = select_experts(torch.randn(n, E, generator=gen), K, True, torch.float32)
    return x, weights, ids


def _rank_main(rank: int, store_port: int, tp_ports: list[int], out_dir: str) -> None:
    from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

    torch.set_num_threads(1)
    core, tp_rank = divmod(rank, 2)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tp_ports[core]}",
                            rank=tp_rank, world_size=2)
    store = TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=60))
    group = ProcessGroupGloo(PrefixStore("ep", store), rank, 4, timedelta(seconds=60))
    tp = TPGroup(rank=tp_rank, world_size=2, group=dist.group.WORLD)
    ep = EPGroup(rank=rank, world_size=4, group=group, tp=tp)
    layer = FusedMoE(E, H, INTER, tp=tp, ep=ep, dtype=torch.float32)
    w13, w2 = _weights()
    for e in range(E):
        layer.load_expert(e, "gate_proj", w13[e, :INTER])
        layer.load_expert(e, "up_proj", w13[e, INTER:])
        layer.load_expert(e, "down_proj", w2[e])
    layer.process_weights_after_loading()
    try:
        for step, n in enumerate((5, 1)):
            if core == 0:
                out = layer.forward(*_tokens(n, step))
                torch.save(out, Path(out_dir) / f"core0-tp{tp_rank}-step{step}.pt")
            else:
                layer.dummy_pass(H, torch.float32, torch.device("cpu"))
    finally:
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)


@pytest.mark.slow
def test_dispatch_over_two_cores_of_tp2_with_one_idle(tmp_path: Path) -> None:
    from torch._C._distributed_c10d import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.spawn(_rank_main, args=(store.port, [free_port(), free_port()], str(tmp_path)), nprocs=4,
             join=True)
    w13, w2 = _weights()
    for step, n in enumerate((5, 1)):
        want = grouped.per_expert_loop(*(lambda x, w, i: (x, w13, w2, w, i))(*_tokens(n, step)))
        for tp_rank in (0, 1):
            got = torch.load(tmp_path / f"core0-tp{tp_rank}-step{step}.pt")
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_expert_split_needs_a_divisor() -> None:
    ep = EPGroup(rank=1, world_size=4, group=None)
    assert ep.expert_range(8) == range(2, 4)
    with pytest.raises(ValueError, match="divisible"):
        ep.expert_range(6)
