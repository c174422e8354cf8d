"""Weight loading: safetensors (single file or sharded), GGUF, or dummy weights.

The worker calls `load_model`: it builds the architecture's model from the registry directly on
the target device in the configured dtype, then streams the checkpoint tensor by tensor into it
(`ringserve.checkpoint.safetensors_file.TensorReader` reads each tensor into a buffer of its
own, not through mmap; GGUF tensors are dequantized one at a time by
`ringserve.checkpoint.gguf_file`, or, for a quantized model, the ones whose codes the layers
keep come as their bytes only, deferred, and a layer makes floats of those only where it
needs them); each parallel layer narrows a tensor to this rank's shard and
copies it into its parameter, converting the dtype (bf16 weights into float32 compute on CPU).
So peak memory is the model plus one checkpoint tensor. Then the model repacks its weights for
the device (`process_weights_after_loading`: oneDNN's layout on CPU). `--load-format dummy`
fills every parameter with small random values instead (benchmarks of a shape without its
weights). The config was read and checked (shards present, headers whole, float dtypes) by
`ringserve.config.ModelConfig` before any process started.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from ringserve.checkpoint.safetensors_file import TensorReader, checkpoint_files
from ringserve.config import ModelConfig
from ringserve.errors import ModelDirectoryError
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.models.registry import model_class


def load_model(
    config: ModelConfig, *, tp: TPGroup, device: torch.device, backend: AttentionBackend
) -> LlamaForCausalLM:
    """Build and load the model of `config` on `device`.

    Raises:
        ValueError: unsupported architecture, rope type or tensor-parallel split.
        ModelDirectoryError: the weights are missing, or a tensor does not fit the model
            (the message names the file and the tensor).
    """
    cls = model_class(config.architecture)
    with torch.device(device):
        model = cls.from_config(config, tp, backend)
    if config.load_format == "dummy":
        fill_dummy_weights(model, config.seed)
    elif config.load_format == "gguf":
        from ringserve.checkpoint.gguf_file import iterate_gguf_weights

        path = Path(config.weights)
        # A quantized model reads the tensors whose codes its layers keep without their
        # floats (made by a layer only where it needs them): no float copy of the model.
        weights = iterate_gguf_weights(path, config.hf_config,
                                       deferred=config.quantization is not None)
        _load(model, weights, lambda: str(path))
    else:
        reader = TensorReader(checkpoint_files(Path(config.weights)), reuse_buffer=True)
        skip = _HEAD_TENSORS if config.architecture.endswith("ForSequenceClassification") else ()
        _load(model, ((n, t) for n, t in reader if n not in skip), reader.describe)
    model.process_weights_after_loading()
    return model.eval()


# A decoder classifier's head (`*ForSequenceClassification`): read by the pooler
# (`ringserve.gpu.pooling.decoder`), not by the model.
_HEAD_TENSORS = ("score.weight",)
# The tensor names of a decoder's base model when it is saved without its LM head's wrapper.
_BARE_PREFIXES = ("layers.", "embed_tokens.", "norm.")


def _load(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]],
          where: Callable[[], str]) -> None:
    """`model.load_weights`, with errors naming where the offending tensor came from."""
    current: list[str] = []

    def named() -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            current[:] = [name]
            if name.startswith(_BARE_PREFIXES):
                # A base model saved on its own (Qwen3-Embedding's `Qwen3Model`): no `model.`.
                name = "model." + name
            yield name, tensor
        current.clear()  # an error after the last tensor (one missing) names no tensor

    try:
        model.load_weights(named())
    except ModelDirectoryError:
        raise
    except (ValueError, RuntimeError) as exc:
        source = where()
        tensor = f"tensor {current[0]!r}: " if current else ""
        raise ModelDirectoryError(f"{source}: {tensor}{exc}") from None


def fill_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Small uniform random values in every parameter (norm scales at 1), deterministic in
    `seed` and the same on every rank for replicated parameters."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() == 1 and "norm" in name:
            param.data.fill_(1.0)
            continue
        values = torch.empty(param.shape, dtype=torch.float32).uniform_(-1e-3, 1e-3,
                                                                         generator=gen)
        param.data.copy_(values)
