"""Token-exact parity with transformers' greedy `generate` (float32) for every tiny family and
both CPU attention backends (torch reference, C kernel):
mixed prompt lengths in one batch, chunked prefill (a 16-token budget), a prefix-cache hit
(blocks reused from an earlier request), and logprobs against transformers' log_softmax."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gpu_helpers import make_runner
from runner_driver import ToyScheduler

from ringserve.gpu.attention import cpu_native
from ringserve.gpu.attention.backend import BackendName
from ringserve.sampling_params import SamplingParams

NEW_TOKENS = 8


def _hf_greedy(model: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS, output_logits=True, return_dict_in_generate=True,
    )
    logprobs = torch.stack(out.logits, dim=1)[0].float().log_softmax(-1)
    return out.sequences[0, len(prompt):].tolist(), logprobs


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_parity_with_chunked_prefill_and_prefix_hits(tiny_model_dir: Path,
                                                            backend: BackendName) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 8000, (n,), generator=gen).tolist() for n in (5, 17, 33, 2)]
    shared = prompts[2][:24] + torch.randint(3, 8000, (6,), generator=gen).tolist()
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    expected = [_hf_greedy(hf, p) for p in [*prompts, shared]]

    if backend == "cpu" and cpu_native.load_kernel() is None:
        pytest.skip("the CPU kernel does not build here (no cc/OpenMP)")
    runner = make_runner(tiny_model_dir, backend=backend)
    sched = ToyScheduler(runner, budget=16)
    greedy = SamplingParams(temperature=0.0, min_tokens=NEW_TOKENS, max_tokens=NEW_TOKENS, logprobs=3)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, greedy, NEW_TOKENS)
    sched.run()
    sched.add("shared", shared, greedy, NEW_TOKENS)
    assert sched.prefix_hits == 1 and sched.running[0].num_computed == 24
    sched.run()

    for req_id, (tokens, hf_logprobs) in zip([*[f"r{i}" for i in range(4)], "shared"], expected, strict=True):
        req = sched.done[req_id]
        assert req.output == tokens, req_id
        ours = np.stack([lp.logprobs for lp in req.logprobs])
        ids = np.stack([lp.token_ids for lp in req.logprobs])
        ref = hf_logprobs.gather(1, torch.from_numpy(ids).long()).numpy()
        np.testing.assert_allclose(ours, ref, atol=1e-4)
        assert all(int(lp.ranks) == 1 for lp in req.logprobs)
        assert (ids[:, 0] == ids[:, 1]).all()  # greedy: the sampled token is the top-1


@pytest.mark.slow
def test_seeded_request_is_batch_independent(tiny_llama_dir: Path) -> None:
    runner = make_runner(tiny_llama_dir)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=6)
    prompt = list(range(10, 20))

    alone = ToyScheduler(runner, budget=64)
    alone.add("seeded", prompt, params, 6)
    tokens_alone = alone.run()["seeded"]

    mixed = ToyScheduler(make_runner(tiny_llama_dir), budget=7)
    mixed.add("other1", list(range(100, 140)), SamplingParams(temperature=1.0), 4)
    mixed.add("seeded", prompt, params, 6)
    mixed.add("other2", [5, 6, 7], SamplingParams(temperature=0.0), 9)
    assert mixed.run()["seeded"] == tokens_alone
