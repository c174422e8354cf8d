"""Gemma 2, Gemma 3 (text), Phi-3 and Phi-4-mini against transformers' greedy `generate`
(float32), token for token, with logprobs: chunked prefill (a 16-token budget), a prefix-cache
hit, and 8-token sliding windows that every prompt but the shortest crosses. The tiny presets
turn the families' features on (see `ringserve.gpu.testing.PRESETS`): Gemma 2's attention and
final soft-caps, Gemma 3's q/k norms and local rope table with linear-scaled global rope,
Phi-4-mini's partial rotary and longrope (within its original context: past it transformers'
Phi-3 `generate` recomputes the whole sequence, which a paged cache does not). Also TP=2 over
gloo for each family, and the loaders' and configs' error paths."""

from __future__ import annotations

import dataclasses
import functools
import json
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpu_helpers import make_runner
from runner_driver import ToyScheduler

from ringserve.config import ModelConfig
from ringserve.gpu.attention import cpu_native
from ringserve.gpu.attention.backend import BackendName, TorchAttentionBackend
from ringserve.gpu.models.gemma import GemmaSpec
from ringserve.gpu.models.registry import model_class
from ringserve.gpu.parallel import TPGroup
from ringserve.gpu.testing import tiny_model
from ringserve.sampling_params import SamplingParams

FAMILIES = ("gemma2", "gemma3", "phi3", "phi4mini")
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, min_tokens=NEW_TOKENS, max_tokens=NEW_TOKENS, logprobs=3)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 8000, (n,), generator=gen).tolist() for n in (5, 17, 33, 2)]
    shared = prompts[2][:24] + torch.randint(3, 8000, (6,), generator=gen).tolist()
    return [*prompts, shared]


@functools.cache
def _expected(family: str) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens and per-step log-softmax for each prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model(family)), dtype=torch.float32).eval()
    expected = []
    for prompt in _prompts():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, output_logits=True, return_dict_in_generate=True)
        logprobs = torch.stack(out.logits, dim=1)[0].float().log_softmax(-1)
        expected.append((out.sequences[0, len(prompt):].tolist(), logprobs))
    return expected


def _run(model_dir: Path, backend: BackendName = "torch", tp: TPGroup | None = None) -> ToyScheduler:
    """Four prompts chunked under a 16-token budget, then one sharing 24 cached tokens."""
    sched = ToyScheduler(make_runner(model_dir, backend=backend, tp=tp), budget=16)
    *prompts, shared = _prompts()
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, GREEDY, NEW_TOKENS)
    sched.run()
    sched.add("shared", shared, GREEDY, NEW_TOKENS)
    assert sched.prefix_hits == 1 and sched.running[0].num_computed == 24
    sched.run()
    return sched


REQ_IDS = ("r0", "r1", "r2", "r3", "shared")


# The CPU default (the C decode kernel, torch for prefill chunks) for every family, and the
# torch reference's batched decode path once, on the family with both soft-caps.
@pytest.mark.slow
@pytest.mark.parametrize(("family", "backend"), [*((f, "cpu") for f in FAMILIES),
                                                 ("gemma2", "torch")])
def test_family_greedy_parity(family: str, backend: BackendName) -> None:
    torch.set_num_threads(2)
    if backend == "cpu" and cpu_native.load_kernel() is None:
        backend = "torch"  # no cc/OpenMP here: the reference covers the family instead
    expected = _expected(family)
    sched = _run(tiny_model(family), backend)
    for req_id, (tokens, hf_logprobs) in zip(REQ_IDS, expected, strict=True):
        req = sched.done[req_id]
        assert req.output == tokens, req_id
        ours = np.stack([lp.logprobs for lp in req.logprobs])
        ids = np.stack([lp.token_ids for lp in req.logprobs])
        # The final soft-cap shows here: the logprobs are those of the capped logits.
        ref = hf_logprobs.gather(1, torch.from_numpy(ids).long()).numpy()
        np.testing.assert_allclose(ours, ref, atol=1e-4)


# Phi-4-mini stands for Phi-3 here: the same class and fused-checkpoint split, plus its tied
# head and partial rotary; each rank holds one of the two KV heads.
TP_FAMILIES = ("gemma2", "gemma3", "phi4mini")


def _rank_main(rank: int, port: int, out_path: str) -> None:
    from ringserve.gpu.parallel import init_tp_group

    torch.set_num_threads(1)
    tp = init_tp_group(rank, 2, backend="gloo", init_method=f"tcp://127.0.0.1:{port}")
    try:
        tokens = {f: {r: _run(tiny_model(f), tp=tp).done[r].output for r in REQ_IDS}
                  for f in TP_FAMILIES}
        if rank == 0:
            Path(out_path).write_text(json.dumps(tokens))
    finally:
        # As in test_gpu_tp: leave gloo's threads no chance to abort the process at teardown.
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_tp2_matches_transformers_for_each_family(tmp_path: Path) -> None:
    for family in TP_FAMILIES:
        tiny_model(family)  # built here, not raced for by the two ranks
    out = tmp_path / "tokens.json"
    mp.spawn(_rank_main, args=(_free_port(), str(out)), nprocs=2, join=True)
    got = json.loads(out.read_text())
    for family in TP_FAMILIES:
        want = {r: tokens for r, (tokens, _) in zip(REQ_IDS, _expected(family), strict=True)}
        assert got[family] == want, family


def _config(family: str, **hf_overrides: Any) -> ModelConfig:
    config = ModelConfig.from_model_dir(str(tiny_model(family)))
    return dataclasses.replace(config, hf_config={**config.hf_config, **hf_overrides})


def test_gemma_spec_reads_the_config() -> None:
    spec = GemmaSpec.from_gemma_config(_config("gemma3"), "gemma3")
    assert spec.layer_types == ("sliding_attention", "full_attention")
    assert (spec.sliding_window, spec.query_pre_attn_scalar, spec.head_dim) == (8, 24.0, 32)
    assert spec.attn_logit_softcap is None and spec.final_logit_softcap == 3.0 and spec.qk_norm
    assert spec.rope["rope_type"] == "linear" and spec.rope_local is not None
    assert spec.rope_local["rope_theta"] == 10000.0
    old = GemmaSpec.from_gemma_config(_config("gemma2", layer_types=None), "gemma2")
    assert old.layer_types == ("sliding_attention", "full_attention")
    assert old.attn_logit_softcap == 2.0 and old.rope_local is None


@pytest.mark.parametrize(("overrides", "message"), [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, "hidden_activation: got 'relu'"),
    ({"layer_types": ["sliding_attention"]}, "layer_types: got"),
])
def test_gemma_config_errors(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GemmaSpec.from_gemma_config(_config("gemma2", **overrides), "gemma2")


def test_phi3_fused_tensor_of_the_wrong_size_is_refused() -> None:
    config = _config("phi3")
    with torch.device("meta"):
        model = model_class("Phi3ForCausalLM").from_config(config, TPGroup(), TorchAttentionBackend())
    bad = [("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(10, config.hidden_size))]
    with pytest.raises(ValueError, match=r"qkv_proj.weight.*10 rows, expected 128 \(64 \+ 32 \+ 32\)"):
        model.load_weights(bad)


@pytest.mark.slow
def test_mistral_sliding_window_parity(tiny_mistral_dir: Path, tmp_path: Path) -> None:
    """Mistral v0.1-style: the config's window (8 here, crossed by the prompts) on every
    layer; the weights do not depend on it, so the tiny Mistral's config is edited."""
    import shutil

    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model_dir = tmp_path / "mistral-window"
    shutil.copytree(tiny_mistral_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["sliding_window"] = 8
    (model_dir / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    sched = _run(model_dir, "cpu" if cpu_native.load_kernel() is not None else "torch")
    for req_id, prompt in zip(REQ_IDS, _prompts(), strict=True):
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS)
        assert sched.done[req_id].output == out[0, len(prompt):].tolist(), req_id
