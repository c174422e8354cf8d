"""Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral against transformers' greedy `generate`
(float32), token for token with logprobs, on tiny random-weight models with 8 (4) experts and
top-2 routing: chunked prefill under a 16-token budget and a prefix-cache hit. The router
chooses the same experts as transformers' for every token. TP=2 (each rank a slice of every
expert) and EP=2 (each rank half the experts, tokens exchanged by all-to-all) over gloo give
the same tokens."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_helpers import (
    PARITY_REQ_IDS,
    assert_matches_hf,
    free_port,
    hf_greedy,
    make_runner,
    parity_prompts,
    run_parity,
)

from ringserve.gpu.attention.backend import BackendName
from ringserve.gpu.moe.dispatch import EPGroup, set_ep_group
from ringserve.gpu.moe.router import select_experts
from ringserve.gpu.testing import tiny_model

FAMILIES = ("qwen3moe", "qwen2moe", "mixtral")
NEW_TOKENS = 8


@functools.cache
def _expected(family: str) -> list[tuple[list[int], torch.Tensor]]:
    return hf_greedy(tiny_model(family), NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "cpu"])  # cpu: decodes in the captured C step
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_greedy_parity(family: str, backend: BackendName) -> None:
    torch.set_num_threads(2)
    runner = make_runner(tiny_model(family), backend=backend)
    assert (runner.capture is not None) == (backend == "cpu"), runner.capture_reason
    assert_matches_hf(run_parity(runner, NEW_TOKENS), _expected(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_router_chooses_transformers_experts(family: str) -> None:
    """The same experts (and weights) as transformers' router, token for token, on the
    hidden states of a real prompt at every sparse layer."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model(family)), dtype=torch.float32)
    hidden: list[torch.Tensor] = []
    routers = [m for name, m in hf.named_modules() if name.endswith(("mlp.gate", "moe.gate"))]
    assert routers
    hooks = [r.register_forward_hook(lambda mod, args, out: hidden.append(args[0]))
             for r in routers]
    try:
        with torch.no_grad():
            hf(torch.tensor([parity_prompts()[2]]))
    finally:
        for h in hooks:
            h.remove()
    for router, x in zip(routers, hidden, strict=True):
        _, hf_weights, hf_ids = router(x)
        logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), router.weight)
        weights, ids = select_experts(logits, router.top_k, family != "qwen2moe", x.dtype)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)


def _rank_main(rank: int, port: int, out_path: str, mode: str) -> None:
    from ringserve.gpu.layers.parallel import init_tp_group

    torch.set_num_threads(1)
    tp = init_tp_group(rank, 2, backend="gloo", init_method=f"tcp://127.0.0.1:{port}")
    if mode == "ep":
        set_ep_group(EPGroup(rank=rank, world_size=2, group=dist.group.WORLD, tp=tp))
    try:
        tokens = {f: {r: run_parity(make_runner(tiny_model(f), tp=tp), NEW_TOKENS).done[r].output
                      for r in PARITY_REQ_IDS} for f in FAMILIES}
        if rank == 0:
            Path(out_path).write_text(json.dumps(tokens))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_tp2_and_ep2_match_transformers(tmp_path: Path, mode: str) -> None:
    for family in FAMILIES:
        tiny_model(family)  # built here, not raced for by the two ranks
    out = tmp_path / "tokens.json"
    mp.spawn(_rank_main, args=(free_port(), str(out), mode), nprocs=2, join=True)
    got = json.loads(out.read_text())
    for family in FAMILIES:
        want = {r: tokens for r, (tokens, _) in zip(PARITY_REQ_IDS, _expected(family), strict=True)}
        assert got[family] == want, family
