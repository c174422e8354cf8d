"""A LoRA adapter's weights, read from `adapter_model.safetensors` and checked against the
base model, as deltas on ringserve's fused linear layers.

PEFT names a module's factors `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`
([r, in]) and `...lora_B.weight` ([out, r]). ringserve fuses q / k / v into `qkv_proj` and
gate / up into `gate_up_proj` (`ringserve.gpu.models.llama`), so each PEFT module becomes a
part of a fused layer's output: q at column 0, k at q_size, v at q_size + kv_size; gate at 0,
up at intermediate_size. Phi-3's own fused `qkv_proj` / `gate_up_proj` targets cover the whole
fused output. B is multiplied by the module's scale (`AdapterConfig.scale_of`) here, once.

`load_adapter` is called by the worker's LoRA manager (`ringserve.gpu.lora.manager`) when a
step first needs an adapter; `ringserve.gpu.lora.layers.LoRASlots.load` copies the result
into a slot. Tensor parallelism is not handled here yet (the deltas are the full matrices).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ringserve.config import ModelConfig
from ringserve.gpu.lora.adapter_config import WEIGHTS_FILE, AdapterConfig

# ringserve's fused linear layers that take LoRA deltas, per decoder layer.
TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

# PEFT module name -> (its block in the decoder layer, ringserve's layer, part index; None:
# the whole output of the fused layer)
_PEFT_MODULES: dict[str, tuple[str, str, int | None]] = {
    "q_proj": ("self_attn", "qkv_proj", 0),
    "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2),
    "qkv_proj": ("self_attn", "qkv_proj", None),
    "o_proj": ("self_attn", "o_proj", None),
    "gate_proj": ("mlp", "gate_up_proj", 0),
    "up_proj": ("mlp", "gate_up_proj", 1),
    "gate_up_proj": ("mlp", "gate_up_proj", None),
    "down_proj": ("mlp", "down_proj", None),
}

_NAME = re.compile(r"^base_model\.model\.(?P<module>model\.layers\.(?P<layer>\d+)\.(?P<block>\w+)"
                   r"\.(?P<leaf>\w+))\.lora_(?P<factor>[AB])\.weight$")


class LoRADelta(NamedTuple):
    """One PEFT module's delta on a fused layer: `y[:, offset:offset + width] += (x Aᵀ) Bᵀ`.

    Attributes:
        a: A, [r, in] float32.
        b: B times the module's scale, [width, r] float32.
        offset: the first output column of the fused layer this part writes.
        width: the part's output columns.
    """

    a: torch.Tensor
    b: torch.Tensor
    offset: int
    width: int


@dataclass
class LoRAAdapter:
    """An adapter's deltas, in host memory.

    Attributes:
        config: the adapter's checked config.
        deltas: (layer index, ringserve layer name in `TARGETS`) -> the PEFT modules' deltas
            on that layer (q / k / v parts, gate / up parts, or one whole-output delta).
    """

    config: AdapterConfig
    deltas: dict[tuple[int, str], list[LoRADelta]]


@dataclass(frozen=True)
class _Shapes:
    """The base model's shapes, per PEFT module: (input features, output features, offset)."""

    layers: int
    modules: dict[str, tuple[int, int, int]]

    @classmethod
    def of(cls, config: ModelConfig) -> _Shapes:
        hidden, d = config.hidden_size, config.head_dim
        q, kv = config.num_attention_heads * d, config.num_kv_heads * d
        inter = int(config.hf_config["intermediate_size"])
        return cls(config.num_hidden_layers, {
            "q_proj": (hidden, q, 0), "k_proj": (hidden, kv, q), "v_proj": (hidden, kv, q + kv),
            "qkv_proj": (hidden, q + 2 * kv, 0), "o_proj": (q, hidden, 0),
            "gate_proj": (hidden, inter, 0), "up_proj": (hidden, inter, inter),
            "gate_up_proj": (hidden, 2 * inter, 0), "down_proj": (inter, hidden, 0),
        })


def load_adapter(config: AdapterConfig, model_config: ModelConfig) -> LoRAAdapter:
    """Read the adapter's weights and check them against the base model.

    Args:
        config: the adapter's config (`ringserve.gpu.lora.adapter_config.read_adapter_config`).
        model_config: the base model.

    Raises:
        ValueError: the weights file is missing or unreadable (naming it), holds a tensor
            that is not a LoRA factor of a supported module (naming it), or a factor whose
            shape does not fit the model or the config's rank (naming the module).
    """
    tensors = _read(Path(config.path) / WEIGHTS_FILE)
    shapes = _Shapes.of(model_config)
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _NAME.match(name)
        if match is None:
            raise ValueError(f"{WEIGHTS_FILE}: tensor {name!r} is not a LoRA factor of a decoder "
                             f"layer's projection{_why_not(name)}")
        _check_module(match, config, shapes)
        factors.setdefault(match["module"], {})[match["factor"]] = tensor
    if not factors:
        raise ValueError(f"{WEIGHTS_FILE}: holds no LoRA weights")
    deltas: dict[tuple[int, str], list[LoRADelta]] = {}
    for module, pair in sorted(factors.items(), key=lambda item: _order(item[0])):
        layer, leaf = _order(module)[0], module.rpartition(".")[2]
        deltas.setdefault((layer, _PEFT_MODULES[leaf][1]), []).append(
            _delta(module, pair, config, shapes.modules[leaf]))
    return LoRAAdapter(config=config, deltas=deltas)


def _order(module: str) -> tuple[int, int]:
    """(layer, position of the PEFT module in `_PEFT_MODULES`): q, k, v before o, and so on,
    so a fused layer's parts come in column order."""
    return int(module.split(".")[2]), list(_PEFT_MODULES).index(module.rpartition(".")[2])


def _read(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"{WEIGHTS_FILE}: not found in {str(path.parent)!r}")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{WEIGHTS_FILE}: cannot be read (truncated or not a safetensors "
                         f"file?): {e}") from None


def _why_not(name: str) -> str:
    if ".experts." in name or ".shared_expert." in name:
        return " (LoRA on mixture-of-experts layers is not supported)"
    if "embed_tokens" in name or "lm_head" in name:
        return " (LoRA on the embedding or the LM head is not supported)"
    return ""


def _check_module(match: re.Match[str], config: AdapterConfig, shapes: _Shapes) -> None:
    module, leaf, block = _short(match["module"]), match["leaf"], match["block"]
    if leaf not in _PEFT_MODULES or _PEFT_MODULES[leaf][0] != block:
        raise ValueError(f"{WEIGHTS_FILE}: {module}: not a supported LoRA module")
    if leaf not in config.target_modules:
        raise ValueError(f"{WEIGHTS_FILE}: {module}: not in adapter_config.json's "
                         f"target_modules {list(config.target_modules)}")
    layer = int(match["layer"])
    if layer >= shapes.layers:
        raise ValueError(f"{module}: this model has {shapes.layers} layers (an adapter for "
                         "another base model?)")


def _short(module: str) -> str:
    """A module's name without the leading "model." ("layers.3.self_attn.q_proj")."""
    return module.removeprefix("model.")


def _delta(module: str, pair: dict[str, torch.Tensor], config: AdapterConfig,
           shape: tuple[int, int, int]) -> LoRADelta:
    """The checked delta of PEFT module `module` ("model.layers.3.self_attn.q_proj")."""
    short, leaf = _short(module), module.rpartition(".")[2]
    for factor in "AB":
        if factor not in pair:
            raise ValueError(f"{WEIGHTS_FILE}: {short}: lora_{factor} is missing")
    a, b = pair["A"], pair["B"]
    in_features, out_features, offset = shape
    r = config.rank_of(module)
    for factor, tensor in (("A", a), ("B", b)):
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{short}.lora_{factor}: dtype {tensor.dtype} is not a float type")
        if tensor.dim() != 2:
            raise ValueError(f"{short}.lora_{factor}: shape {list(tensor.shape)} is not a matrix")
    if a.shape[1] != in_features:
        raise ValueError(f"{short}.lora_A: shape {list(a.shape)} does not fit this model's {leaf} "
                         f"input {in_features} (an adapter for another base model?)")
    if b.shape[0] != out_features:
        raise ValueError(f"{short}.lora_B: shape {list(b.shape)} does not fit this model's {leaf} "
                         f"output {out_features} (an adapter for another base model?)")
    if a.shape[0] != r or b.shape[1] != r:
        raise ValueError(f"{short}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not have "
                         f"the rank {r} that adapter_config.json gives this module")
    scaled = b.to(torch.float32) * config.scale_of(module)
    return LoRADelta(a=a.to(torch.float32).contiguous(), b=scaled.contiguous(), offset=offset,
                     width=out_features)
