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
from pathlib import Path
from typing import Any

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
from runner_driver import ToyScheduler

from ringserve.config import ModelConfig
from ringserve.gpu.attention import cpu_native
from ringserve.gpu.attention.backend import BackendName, TorchAttentionBackend
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.models.gemma import GemmaSpec
from ringserve.gpu.models.registry import model_class
from ringserve.gpu.testing import tiny_model

FAMILIES = ("gemma2", "gemma3", "phi3", "phi4mini")
NEW_TOKENS = 8


@functools.cache
def _expected(family: str) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens and per-step log-softmax for each prompt."""
    return hf_greedy(tiny_model(family), NEW_TOKENS)


def _run(model_dir: Path, backend: BackendName = "torch", tp: TPGroup | None = None) -> ToyScheduler:
    """Four prompts chunked under a 16-token budget, then one sharing 24 cached tokens."""
    return run_parity(make_runner(model_dir, backend=backend, tp=tp), NEW_TOKENS)


REQ_IDS = PARITY_REQ_IDS


# The CPU default (the C decode kernel, torch for prefill chunks) for every family, and the
# torch reference's batched decode path once, on the family with both soft-caps.
@pytest.mark.slow
@pytest.mark.parametrize(("family", "backend"), [*((f, "cpu") for f in FAMILIES),
                                                 ("gemma2", "torch")])
def test_family_greedy_parity(family: str, backend: BackendName) -> None:
    torch.set_num_threads(2)
    if backend == "cpu" and cpu_native.load_kernel() is None:
        backend = "torch"  # no cc/OpenMP here: the reference covers the family instead
    # The final soft-cap shows in the logprobs: they are those of the capped logits.
    assert_matches_hf(_run(tiny_model(family), backend), _expected(family))


# Phi-4-mini stands for Phi-3 here: the same class and fused-checkpoint split, plus its tied
# head and partial rotary; each rank holds one of the two KV heads.
TP_FAMILIES = ("gemma2", "gemma3", "phi4mini")


def _rank_main(rank: int, port: int, out_path: str) -> None:
    from ringserve.gpu.layers.parallel import init_tp_group

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


@pytest.mark.slow
def test_tp2_matches_transformers_for_each_family(tmp_path: Path) -> None:
    for family in TP_FAMILIES:
        tiny_model(family)  # built here, not raced for by the two ranks
    out = tmp_path / "tokens.json"
    mp.spawn(_rank_main, args=(free_port(), str(out)), nprocs=2, join=True)
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
    for req_id, prompt in zip(REQ_IDS, parity_prompts(), strict=True):
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS)
        assert sched.done[req_id].output == out[0, len(prompt):].tolist(), req_id
