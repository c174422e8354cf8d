"""A weight update into the standby model (`ringserve.gpu.weights.standby`): the round is loaded
straight into a second, processed model that is swapped in at `finish`; the serving model is
never written, so every failed round leaves it as it was. Driven through the real shm transport
(`TrainerWeightTransferEngine`) with the worker's `WeightUpdater` as the engine."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_helpers import make_runner
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.native.panel import load_library
from ringserve.gpu.runner.model_runner import ModelRunner
from ringserve.gpu.weights.standby import standby_unsupported
from ringserve.gpu.weights.update import WeightUpdateError, WeightUpdater, weight_checksum
from ringserve.weight_transfer import StateDictSource, TrainerWeightTransferEngine

SHM = {"backend": "shm", "bucket_bytes": 1 << 20}  # several buckets per round

pytestmark = pytest.mark.skipif(load_library() is None, reason="no C compiler for the panels")


class _Engine:
    """The sync client a trainer drives, calling one worker's `WeightUpdater` directly."""

    def __init__(self, runner: ModelRunner, model_dir: Path,
                 quantization: str | None = None) -> None:
        config = EngineArgs(model=str(model_dir), device="cpu",
                            weight_transfer_config=SHM, quantization=quantization,
                            max_model_len=256).create_engine_config()
        self.updater = WeightUpdater(config, runner.tp, runner.device, runner.backend,
                                     lambda: runner.model, runner.swap_model,
                                     runner.capture_decode)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.updater.init(init_info, 0, 1)

    def start_weight_update(self, metadata: dict[str, Any] | None = None) -> None:
        self.updater.start(metadata)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.updater.update(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        del weight_version
        self.updater.finish()


@pytest.fixture
def hf_weights(tiny_llama_dir: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.fixture
def runner(tiny_llama_dir: Path) -> ModelRunner:
    return make_runner(tiny_llama_dir, backend="cpu")  # the captured decode step too


def _scaled(weights: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {name: t * factor for name, t in weights.items()}


def _fresh_checksum(model_dir: Path, weights: dict[str, torch.Tensor], tmp: Path) -> str:
    """The checksum of a runner loaded at start-up with `weights`."""
    out = tmp / f"ckpt-{len(list(tmp.iterdir()))}"
    shutil.copytree(model_dir, out)
    (out / "model.safetensors").unlink()
    save_file({n: t.contiguous() for n, t in weights.items()}, str(out / "model.safetensors"))
    return weight_checksum(make_runner(out, backend="cpu").model)


@pytest.fixture
def trainer(runner: ModelRunner, tiny_llama_dir: Path
            ) -> Iterator[tuple[TrainerWeightTransferEngine, _Engine]]:
    engine = _Engine(runner, tiny_llama_dir)
    with TrainerWeightTransferEngine(SHM, engine) as trainer:
        yield trainer, engine


def test_rounds_swap_the_standby_in_and_equal_a_fresh_load(
        runner: ModelRunner, trainer: tuple[TrainerWeightTransferEngine, _Engine],
        hf_weights: dict[str, torch.Tensor], tiny_llama_dir: Path, tmp_path: Path) -> None:
    trainer_engine, engine = trainer
    first = runner.model
    start_checksum = weight_checksum(first)
    new = _scaled(hf_weights, 0.5)
    source = dict(new)
    trainer_engine.trainer_init(StateDictSource(source))
    trainer_engine.send_weights()
    assert engine.updater.standby is True
    second = runner.model
    assert second is not first
    assert weight_checksum(first) == start_checksum  # the replaced model was never written
    assert weight_checksum(second) == _fresh_checksum(tiny_llama_dir, new, tmp_path)
    # The decode step was captured again over the new panels.
    assert runner.capture is not None
    qkv = second.model.layers[0].self_attn.qkv_proj.panel
    assert qkv is not None and runner.capture._layers[0].qkv.data == qkv.data.data_ptr()
    # The next round loads into the replaced model and swaps it back.
    source.update(hf_weights)
    trainer_engine.send_weights()
    assert runner.model is first
    assert weight_checksum(first) == start_checksum


def test_failed_rounds_leave_the_serving_weights(
        runner: ModelRunner, trainer: tuple[TrainerWeightTransferEngine, _Engine],
        hf_weights: dict[str, torch.Tensor], tiny_llama_dir: Path, tmp_path: Path) -> None:
    trainer_engine, engine = trainer
    serving, checksum = runner.model, weight_checksum(runner.model)
    new = _scaled(hf_weights, 0.5)
    trainer_engine.trainer_init(StateDictSource(new))
    updater = engine.updater
    metas = StateDictSource(new).metadata()
    metadata = {"names": [m.name for m in metas], "dtype_names": [m.dtype for m in metas],
                "shapes": [list(m.shape) for m in metas]}

    # A round abandoned after some buckets, and a round missing a tensor at finish.
    transport: Any = trainer_engine._transport
    plan = transport.plan(metas)
    for buckets in (plan[:2], plan[:-1]):
        updater.start(metadata)
        tensors = iter(new.items())
        transport.send_round(buckets, tensors, updater.update)
        if buckets is plan[:2]:
            updater.abort()
        else:
            with pytest.raises(WeightUpdateError, match="lacks"):
                updater.finish()
        assert runner.model is serving and weight_checksum(serving) == checksum

    # A tensor of the wrong shape in a bucket (metadata not sent: nothing checks it first).
    bad = dict(new)
    bad["model.layers.0.mlp.down_proj.weight"] = bad["model.layers.0.mlp.down_proj.weight"][:, :8]
    trainer_engine.trainer_init(StateDictSource(bad))
    updater.start(None)
    with pytest.raises(WeightUpdateError, match=r"down_proj.weight': shape"):
        transport = trainer_engine._transport
        transport.send_round(transport.plan(StateDictSource(bad).metadata()),
                             iter(bad.items()), updater.update)
    with pytest.raises(WeightUpdateError, match="no weight update is in progress"):
        updater.finish()
    assert runner.model is serving and weight_checksum(serving) == checksum

    # After the failures, a whole round still lands exactly.
    trainer_engine.trainer_init(StateDictSource(new))
    trainer_engine.send_weights()
    assert weight_checksum(runner.model) == _fresh_checksum(tiny_llama_dir, new, tmp_path)


def test_metadata_is_checked_once_per_distinct_list(
        trainer: tuple[TrainerWeightTransferEngine, _Engine],
        hf_weights: dict[str, torch.Tensor]) -> None:
    updater = trainer[1].updater
    metas = StateDictSource(hf_weights).metadata()
    metadata = {"names": [m.name for m in metas], "dtype_names": [m.dtype for m in metas],
                "shapes": [list(m.shape) for m in metas]}
    first = updater.check_metadata(metadata)
    assert updater.check_metadata({k: list(v) for k, v in metadata.items()}) is first
    wrong = {**metadata, "shapes": [[3], *metadata["shapes"][1:]]}
    with pytest.raises(WeightUpdateError, match="do not match the model"):
        updater.check_metadata(wrong)
    assert updater.check_metadata(metadata) is first


@pytest.mark.parametrize("quantization", ["int8"])
def test_a_quantized_model_loads_into_a_staging_copy(quantization: str, tiny_llama_dir: Path,
                                                     hf_weights: dict[str, torch.Tensor]
                                                     ) -> None:
    runner = make_runner(tiny_llama_dir, quantization=quantization)
    assert "int8 panels" in (standby_unsupported(runner.model) or "")
    engine = _Engine(runner, tiny_llama_dir, quantization)
    serving = runner.model
    with TrainerWeightTransferEngine(SHM, engine) as trainer_engine:
        trainer_engine.trainer_init(StateDictSource(hf_weights))
        trainer_engine.send_weights()
    assert engine.updater.standby is False and runner.model is serving


def test_a_float_model_qualifies_for_the_standby(runner: ModelRunner) -> None:
    assert standby_unsupported(runner.model) is None
