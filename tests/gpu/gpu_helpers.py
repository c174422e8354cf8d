"""Helpers shared by the tests under tests/gpu: engine configs and runners on tiny models."""

from __future__ import annotations

from pathlib import Path

import torch

from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.attention.backend import BackendName
from ringserve.gpu.model_runner import ModelRunner
from ringserve.gpu.parallel import TPGroup


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
