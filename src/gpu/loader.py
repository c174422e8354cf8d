"""Weight loading from a Hugging Face model directory (safetensors, single file or sharded).

The worker calls `load_model`: it builds the architecture's model from the registry directly on
the target device in the configured dtype, then streams the checkpoint tensor by tensor (one
tensor in host memory at a time; each parallel layer narrows it to this rank's shard before the
copy), so two full copies of the weights never coexist; then the model repacks them for the device
(`process_weights_after_loading`: oneDNN's layout on CPU). The config itself was read through
transformers' AutoConfig by `ringserve.config.ModelConfig`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from ringserve.config import ModelConfig
from ringserve.errors import ModelDirectoryError
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.models.registry import model_class
from ringserve.gpu.parallel import TPGroup

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory (from the shard index when there is one).

    Raises:
        ModelDirectoryError: no weights, or the index names a missing shard.
    """
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelDirectoryError(f"{index} names missing shards: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelDirectoryError(f"model directory {model_dir}: no *.safetensors weights")
    return files


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every checkpoint tensor, one file and one tensor at a time."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                yield name, f.get_tensor(name)


def load_model(
    config: ModelConfig, *, tp: TPGroup, device: torch.device, backend: AttentionBackend
) -> LlamaForCausalLM:
    """Build and load the model of `config` on `device`.

    Raises:
        ValueError: unsupported architecture, rope type or tensor-parallel split; or a
            checkpoint that does not match the model.
        ModelDirectoryError: the weights are missing.
    """
    cls = model_class(config.architecture)
    with torch.device(device):
        model = cls.from_config(config, tp, backend)
    model.load_weights(iterate_weights(Path(config.model)))
    model.process_weights_after_loading()
    return model.eval()
