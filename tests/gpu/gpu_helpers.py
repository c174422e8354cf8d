"""Helpers shared by the tests under tests/gpu: engine configs and runners on tiny models."""

from __future__ import annotations

from pathlib import Path

import torch
from runner_driver import ToyScheduler

from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.attention.backend import BackendName
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.runner.model_runner import ModelRunner


def make_runner(
    model_dir: Path,
    *,
    block_size: int = 8,
    num_blocks: int = 256,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    backend: BackendName = "torch",
    device: str = "cpu",
    tp: TPGroup | None = None,
    quantization: str | None = None,
) -> ModelRunner:
    config = EngineArgs(
        model=str(model_dir), block_size=block_size, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, device=device, quantization=quantization,
    ).create_engine_config()
    runner = ModelRunner(config, torch.device(device), tp=tp, attention_backend=backend)
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    return runner


# -- greedy parity against transformers, shared by the family test files --------------------

PARITY_REQ_IDS = ("r0", "r1", "r2", "r3", "shared")


def free_port() -> int:
    """A free loopback TCP port (a torch.distributed rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parity_prompts() -> list[list[int]]:
    """Four prompts (5, 17, 33 and 2 tokens) and a fifth sharing the third's first 24."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 8000, (n,), generator=gen).tolist() for n in (5, 17, 33, 2)]
    shared = prompts[2][:24] + torch.randint(3, 8000, (6,), generator=gen).tolist()
    return [*prompts, shared]


def hf_greedy(model_dir: Path, new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens and per-step log-softmax for each parity prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    expected = []
    for prompt in parity_prompts():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, output_logits=True,
                          return_dict_in_generate=True)
        logprobs = torch.stack(out.logits, dim=1)[0].float().log_softmax(-1)
        expected.append((out.sequences[0, len(prompt):].tolist(), logprobs))
    return expected


def run_parity(runner: ModelRunner, new_tokens: int) -> ToyScheduler:
    """The parity prompts chunked under a 16-token budget, then the one sharing 24 cached
    tokens (a prefix-cache hit); greedy with 3 logprobs."""
    from ringserve.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0, min_tokens=new_tokens, max_tokens=new_tokens,
                            logprobs=3)
    sched = ToyScheduler(runner, budget=16)
    *prompts, shared = parity_prompts()
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, greedy, new_tokens)
    sched.run()
    sched.add("shared", shared, greedy, new_tokens)
    assert sched.prefix_hits == 1 and sched.running[0].num_computed == 24
    sched.run()
    return sched


def assert_matches_hf(sched: ToyScheduler, expected: list[tuple[list[int], torch.Tensor]],
                      atol: float = 1e-4) -> None:
    """Every parity request's tokens equal transformers', and its logprobs are close."""
    import numpy as np

    for req_id, (tokens, hf_logprobs) in zip(PARITY_REQ_IDS, expected, strict=True):
        req = sched.done[req_id]
        assert req.output == tokens, req_id
        ours = np.stack([lp.logprobs for lp in req.logprobs])
        ids = np.stack([lp.token_ids for lp in req.logprobs])
        ref = hf_logprobs.gather(1, torch.from_numpy(ids).long()).numpy()
        np.testing.assert_allclose(ours, ref, atol=atol)
