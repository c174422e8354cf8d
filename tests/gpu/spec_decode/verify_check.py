"""The verify layout's logits against single-token decodes, per attention backend. Imported by
test_spec_verify.py: in a TRITON_INTERPRET=1 subprocess for the Triton backend on CPU (the
variable must be set before the kernels are defined), in process for the torch backend."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_helpers import make_runner

from ringserve.gpu.runner.input_prep import prepare_inputs
from ringserve.gpu.spec_decode.verify import prepare_verify
from ringserve.gpu.wire import NewRequestData, SchedulerOutput
from ringserve.sampling_params import SamplingParams

PROMPT = list(range(40, 53))
DRAFTS = [7, 99, 7, 3]
BLOCKS = [1, 2, 3, 4]


def _prefill(runner: object) -> int:
    so = SchedulerOutput(1, [NewRequestData("r", PROMPT, SamplingParams(temperature=0.0),
                                            BLOCKS, 0)], [], {"r": len(PROMPT)}, len(PROMPT))
    out = runner.execute_model(so)  # type: ignore[attr-defined]
    return int(out.sampled_token_ids[0][0])


@torch.inference_mode()
def verify_logits(model_dir: str, backend: str) -> torch.Tensor:
    """Logits of the last token and each draft position, laid out as a verify step."""
    runner = make_runner(Path(model_dir), backend=backend)  # type: ignore[arg-type]
    _prefill(runner)
    table = runner.table
    table.num_computed[table.slot_of("r")] = len(PROMPT)
    step = prepare_verify(table, ["r"], np.array([1 + len(DRAFTS)]), {"r": DRAFTS},
                          runner.device)
    hidden = runner.model.forward(step.inputs.input_ids, step.inputs.positions,
                                  runner.kv_caches, step.inputs.meta)
    return runner.model.compute_logits(hidden[torch.from_numpy(step.rows[0])]).float()


@torch.inference_mode()
def decode_logits(model_dir: str, backend: str) -> torch.Tensor:
    """The same positions' logits from single-token decodes, one step each."""
    runner = make_runner(Path(model_dir), backend=backend)  # type: ignore[arg-type]
    first = _prefill(runner)
    table = runner.table
    slot = table.slot_of("r")
    rows = []
    for j, token in enumerate([first, *DRAFTS]):
        if j:
            table.append_token(slot, token)
        table.num_computed[slot] = len(PROMPT) + j
        inputs = prepare_inputs(table, ["r"], np.array([1]), runner.device)
        hidden = runner.model.forward(inputs.input_ids, inputs.positions, runner.kv_caches,
                                      inputs.meta)
        rows.append(runner.model.compute_logits(hidden[-1:]).float())
    return torch.cat(rows)


def check(model_dir: str, backend: str) -> None:
    """Verify-layout logits equal single-token decodes' (within float32 rounding) and pick
    the same argmax at every position."""
    got, want = verify_logits(model_dir, backend), decode_logits(model_dir, backend)
    assert got.shape == want.shape == (1 + len(DRAFTS), want.shape[1]), (got.shape, want.shape)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(dim=-1), want.argmax(dim=-1))
