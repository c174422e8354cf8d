"""The captured decode step adds the LoRA slots' deltas itself (issue 42, item 4): a decode
batch mixing two adapters and base rows gives the eager wrappers' hidden states, base rows
untouched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from lora_helpers import peft_adapter

from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.lora.capture import CaptureTables
from ringserve.gpu.lora.layers import LoRABatch, LoRASlots, install_lora
from ringserve.gpu.runner.input_prep import prepare_inputs
from ringserve.gpu.runner.model_runner import ModelRunner
from ringserve.gpu.testing import tiny_model
from ringserve.gpu.wire import NewRequestData, SchedulerOutput
from ringserve.sampling_params import SamplingParams


def test_captured_decodes_add_each_rows_slot_delta(tmp_path: Path) -> None:
    base = tiny_model("llama")
    config = EngineArgs(model=str(base), block_size=8, max_num_seqs=8, max_model_len=128,
                        device="cpu").create_engine_config()
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(64)
    capture = runner.capture
    assert capture is not None, runner.capture_reason
    slots, batch = LoRASlots(3), LoRABatch()
    install_lora(runner.model, slots, batch)
    peft_adapter(base, tmp_path / "a", seed=1)
    peft_adapter(base, tmp_path / "b", seed=2, r=4, alpha=8.0)
    load_slot_into(slots, runner, tmp_path / "a", 0)
    load_slot_into(slots, runner, tmp_path / "b", 2)
    ids = ["r0", "r1", "r2", "r3"]
    prompts = [list(range(10 + i, 20 + i)) for i in range(4)]
    news = [NewRequestData(r, p, SamplingParams(temperature=0.0), [1 + 2 * i, 2 + 2 * i], 0)
            for i, (r, p) in enumerate(zip(ids, prompts, strict=True))]
    runner.execute_model(SchedulerOutput(1, news, [], {r: 10 for r in ids}, 40))
    table = runner.table
    for r in ids:
        table.num_computed[table.slot_of(r)] = 10
    inputs = prepare_inputs(table, ids, np.ones(4, dtype=np.int32), runner.device)
    row_slots = np.array([0, -1, 2, 0], dtype=np.int64)
    CaptureTables().point(capture, slots)
    got, _ = capture.run_keeping(inputs, 0, (), row_slots)
    plain, _ = capture.run_keeping(inputs, 0, ())
    batch.set(torch.from_numpy(row_slots))
    try:
        want = runner.model.forward(inputs.input_ids, inputs.positions, runner.kv_caches,
                                    inputs.meta)
    finally:
        batch.set(None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[1], plain[1])  # the base row is the step without LoRA
    for row in (0, 2, 3):  # the adapters change their rows
        assert not torch.allclose(got[row], plain[row], atol=1e-3)


def load_slot_into(slots: LoRASlots, runner: ModelRunner, path: Path, slot: int) -> None:
    from ringserve.gpu.lora.adapter_config import read_adapter_config
    from ringserve.gpu.lora.weights import load_adapter

    config = read_adapter_config(path, max_lora_rank=16)
    slots.load(slot, load_adapter(config, runner.model_config))
