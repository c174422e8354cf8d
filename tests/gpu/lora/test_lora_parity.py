"""Greedy output under LoRA adapters equals PEFT on transformers (issue 42, item 7): random
adapters with non-zero B saved by PEFT itself, run through an eager ModelRunner with the
adapters in slots; tokens equal and logprobs within 1e-4 of PEFT's generation (unmerged, and
merged with `merge_and_unload`). Chunked prefill and decode steps both run (16-token budget)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from lora_helpers import (
    assert_matches,
    greedy,
    load_slot,
    make_runner,
    peft_adapter,
    prompts,
    run,
)

from ringserve.gpu.lora.adapter_config import read_adapter_config
from ringserve.gpu.testing import tiny_model

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_all_seven_targets(tmp_path: Path, family: str) -> None:
    base = tiny_model(family)
    oracle = peft_adapter(base, tmp_path / "a")
    lr = make_runner(base, max_loras=1)
    load_slot(lr, 0, tmp_path / "a")
    sched = run(lr, [(f"r{i}", p, 0) for i, p in enumerate(prompts())])
    expected = [greedy(oracle, p) for p in prompts()]
    for i, want in enumerate(expected):
        assert_matches(sched, f"r{i}", want)
    if family == "llama":
        merged = oracle.merge_and_unload()
        for i, p in enumerate(prompts()):
            assert_matches(sched, f"r{i}", greedy(merged, p))


def test_rslora_and_patterns(tmp_path: Path) -> None:
    """rsLoRA scales by alpha / sqrt(r); rank_pattern / alpha_pattern give modules their own
    rank and alpha (plain names, a full path, a regex), as PEFT reads them."""
    base = tiny_model("llama")
    rs = peft_adapter(base, tmp_path / "rs", r=8, alpha=12.0, use_rslora=True, seed=1)
    patterned = peft_adapter(
        base, tmp_path / "pat", r=8, alpha=12.0, seed=2,
        rank_pattern={"q_proj": 4, r"layers\.1\.mlp\.(gate|up)_proj": 2,
                      "model.layers.0.mlp.down_proj": 6},
        alpha_pattern={"v_proj": 3.0, "model.layers.1.self_attn.o_proj": 20.0})
    config = read_adapter_config(tmp_path / "pat", max_lora_rank=16)
    for name, module in patterned.named_modules():  # PEFT's own ranks and scales
        if hasattr(module, "scaling") and "default" in getattr(module, "r", {}):
            path = name.removeprefix("base_model.model.")
            assert config.rank_of(path) == module.r["default"], path
            assert config.scale_of(path) == pytest.approx(module.scaling["default"]), path
    lr = make_runner(base, max_loras=2)
    load_slot(lr, 0, tmp_path / "rs")
    load_slot(lr, 1, tmp_path / "pat")
    p = prompts()[1]
    sched = run(lr, [("rs", p, 0), ("pat", p, 1)])
    assert_matches(sched, "rs", greedy(rs, p))
    assert_matches(sched, "pat", greedy(patterned, p))


def test_mixed_batch_of_three_adapters_and_base_rows(tmp_path: Path) -> None:
    """Three adapters and base rows in every step, an adapter's rows scattered among the
    others; each row equals its own oracle, and base rows are bit-identical to a runner
    without LoRA."""
    base = tiny_model("llama")
    oracles = [peft_adapter(base, tmp_path / "a0", seed=10),
               peft_adapter(base, tmp_path / "a1", targets=("q_proj", "v_proj", "o_proj"),
                            r=4, alpha=7.0, seed=11),
               peft_adapter(base, tmp_path / "a2", targets=("gate_proj", "up_proj", "down_proj"),
                            r=16, alpha=4.0, use_rslora=True, seed=12)]
    lr = make_runner(base, max_loras=3)
    for slot in range(3):
        load_slot(lr, slot, tmp_path / f"a{slot}")
    p0, p1, p2 = prompts()
    requests = [("a0-x", p1, 0), ("base-x", p0, -1), ("a1", p2, 1), ("a0-y", p0, 0),
                ("a2", p1, 2), ("base-y", p2, -1)]
    sched = run(lr, requests)
    oracle_of = {0: oracles[0], 1: oracles[1], 2: oracles[2]}
    for req_id, prompt, slot in requests:
        if slot >= 0:
            assert_matches(sched, req_id, greedy(oracle_of[slot], prompt))
    with oracles[0].disable_adapter():
        for req_id, prompt, slot in requests:
            if slot < 0:
                assert_matches(sched, req_id, greedy(oracles[0], prompt))
    plain = run(make_runner(base, lora=False), [(r, p, -1) for r, p, _ in requests])
    for req_id in ("base-x", "base-y"):
        ours, ref = sched.done[req_id], plain.done[req_id]
        assert ours.output == ref.output
        for a, b in zip(ours.logprobs, ref.logprobs, strict=True):
            assert np.array_equal(a.logprobs, b.logprobs) and np.array_equal(a.token_ids,
                                                                              b.token_ids)
    for req_id in ("a0-x", "a1", "a2"):  # the adapters did change something
        assert sched.done[req_id].output != plain.done[req_id].output


def test_phi3_fused_targets(tmp_path: Path) -> None:
    """Phi-3's own fused qkv_proj / gate_up_proj cover the whole fused output."""
    base = tiny_model("phi3")
    oracle = peft_adapter(base, tmp_path / "a", targets=("qkv_proj", "o_proj", "gate_up_proj",
                                                          "down_proj"),
                          rank_pattern={"qkv_proj": 4}, seed=3)
    lr = make_runner(base, max_loras=1)
    load_slot(lr, 0, tmp_path / "a")
    sched = run(lr, [(f"r{i}", p, 0) for i, p in enumerate(prompts())])
    for i, p in enumerate(prompts()):
        assert_matches(sched, f"r{i}", greedy(oracle, p))
