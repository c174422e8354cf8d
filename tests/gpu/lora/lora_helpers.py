"""Helpers for the LoRA tests: random PEFT adapters (the oracle keeps the PEFT model), an eager
ModelRunner with LoRA installed, a toy schedule whose rows carry their adapter's slot, and the
comparison with PEFT's greedy generation."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runner_driver import ToyScheduler

from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.lora.adapter_config import read_adapter_config
from ringserve.gpu.lora.layers import LoRABatch, LoRASlots, install_lora
from ringserve.gpu.lora.weights import load_adapter
from ringserve.gpu.runner.model_runner import ModelRunner
from ringserve.gpu.wire import SchedulerOutput
from ringserve.sampling_params import SamplingParams

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NEW_TOKENS = 6


def prompts() -> list[list[int]]:
    """Three prompts of 5, 17 and 29 tokens (chunked under the toy schedule's budget)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 8000, (n,), generator=gen).tolist() for n in (5, 17, 29)]


def peft_adapter(base: Path, out: Path, *, targets: Sequence[str] = ALL_TARGETS, r: int = 8,
                 alpha: float = 12.0, seed: int = 0, **config: Any) -> Any:
    """A PEFT LoRA model on `base` with random A and B (PEFT starts B at zero), saved as
    safetensors in `out`; returns the PEFT model (the oracle)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    lora = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                      task_type="CAUSAL_LM", **config)
    peft_model = get_peft_model(model, lora).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return peft_model


def greedy(model: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """`model`'s greedy tokens for `prompt` and the log-softmax at each step."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             output_logits=True, return_dict_in_generate=True)
    logprobs = torch.stack(out.logits, dim=1)[0].float().log_softmax(-1)
    return out.sequences[0, len(prompt):].tolist(), logprobs


@dataclass
class LoRARunner:
    runner: ModelRunner
    slots: LoRASlots
    batch: LoRABatch


def make_runner(model_dir: Path, *, max_loras: int = 3, lora: bool = True) -> LoRARunner:
    """An eager ModelRunner on `model_dir`, with LoRA installed unless `lora` is false."""
    config = EngineArgs(model=str(model_dir), block_size=8, max_num_seqs=16, max_model_len=256,
                        device="cpu", enforce_eager=True).create_engine_config()
    runner = ModelRunner(config, torch.device("cpu"), attention_backend="torch")
    runner.load_model()
    runner.initialize_kv_cache(128)
    slots, batch = LoRASlots(max_loras), LoRABatch()
    if lora:
        install_lora(runner.model, slots, batch)
    return LoRARunner(runner, slots, batch)


def load_slot(lr: LoRARunner, slot: int, path: Path) -> None:
    config = read_adapter_config(path, max_lora_rank=16)
    lr.slots.load(slot, load_adapter(config, lr.runner.model_config))


def run(lr: LoRARunner, requests: list[tuple[str, list[int], int]]) -> ToyScheduler:
    """Run `requests` (id, prompt, slot or -1) together, greedy with 3 logprobs, under a
    16-token budget; each step's rows carry their request's slot."""
    slot_of = {req_id: slot for req_id, _, slot in requests}
    execute = lr.runner.execute_model

    def with_slots(so: SchedulerOutput) -> Any:
        per_req = [slot_of[r] for r in so.num_scheduled_tokens]
        rows = np.repeat(np.array(per_req, dtype=np.int64),
                         list(so.num_scheduled_tokens.values()))
        lr.batch.set(torch.from_numpy(rows) if (rows >= 0).any() else None)
        return execute(so)

    lr.runner.execute_model = with_slots  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, min_tokens=NEW_TOKENS, max_tokens=NEW_TOKENS,
                            logprobs=3)
    sched = ToyScheduler(lr.runner, budget=16, prefix_caching=False)
    for req_id, prompt, _ in requests:
        sched.add(req_id, prompt, params, NEW_TOKENS)
    sched.run()
    return sched


def assert_matches(sched: ToyScheduler, req_id: str, expected: tuple[list[int], torch.Tensor],
                   atol: float = 1e-4) -> None:
    """The request's tokens equal the oracle's and its logprobs are within `atol`."""
    tokens, oracle = expected
    req = sched.done[req_id]
    assert req.output == tokens, req_id
    ours = np.stack([lp.logprobs for lp in req.logprobs])
    ids = np.stack([lp.token_ids for lp in req.logprobs])
    ref = oracle.gather(1, torch.from_numpy(ids).long()).numpy()
    np.testing.assert_allclose(ours, ref, atol=atol, err_msg=req_id)
