"""A training script written the way vLLM's RLHF examples write one (issue 38), against a real
engine: its own WeightSource class over the live transformers module, whose metadata are plain
(name, shape, torch.dtype) records, and for gloo vLLM's ``init_info`` (``rank_offset`` 1,
``world_size`` = the engine's workers + 1, a port from the OS). After each optimiser step the
trained weights go through shm or gloo at TP 1 and 2, and ringserve's greedy tokens and
logprobs equal transformers run with those weights."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from test_weight_sync import ENGINE, _check_matches, _train_step
from transformers import AutoModelForCausalLM

from ringserve.engine.frontend.llm import LLM
from ringserve.weight_transfer import TrainerWeightTransferEngine

pytestmark = pytest.mark.slow  # an engine and transformers: seconds


class ParamMeta(NamedTuple):
    name: str
    shape: torch.Size
    dtype: torch.dtype


class PolicySource:
    """The trainer's own source: the module's parameters as they are (live, requiring grad),
    described by plain records."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, p.shape, p.dtype) for name, p in self.module.named_parameters()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.module.named_parameters()


def _open_port() -> int:
    """A free port, as vLLM's examples take one (``get_open_port()``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(("backend", "tp", "family"),
                         [("shm", 1, "llama"), ("gloo", 1, "llama"), ("shm", 2, "qwen2"),
                          ("gloo", 2, "qwen2")])
def test_vllm_style_trainer_pushes_trained_weights(backend: str, tp: int, family: str,
                                                   request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(f"tiny_{family}_dir")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    config = {"backend": backend, "bucket_bytes": 1 << 20}  # several buckets a round
    with LLM(str(model_dir), tensor_parallel_size=tp, weight_transfer_config=config,
             **ENGINE) as llm, TrainerWeightTransferEngine(config, llm) as trainer:
        init_info: dict[str, Any] | None = None
        if backend == "gloo":
            init_info = {"master_address": "127.0.0.1", "master_port": _open_port(),
                         "rank_offset": 1, "world_size": llm.get_world_size() + 1}
        trainer.trainer_init(PolicySource(model), init_info)
        for step in range(1, 2 if tp > 1 else 3):  # TP 2: one round, to stay quick
            before = [p.detach().clone() for p in model.parameters()]
            _train_step(model, opt)
            assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(),
                                                              strict=True))
            model.eval()
            assert trainer.send_weights() == str(step)
            _check_matches(llm, model, str(step))  # transformers with the trained weights
            model.train()
