"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): the Llama decoder read from fused checkpoints.

Phi-3 checkpoints store q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` tensor.
ringserve fuses the same projections, but each rank holds its own slice of every part (see
`ringserve.gpu.layers.linear.ColumnParallelLinear`), so a fused checkpoint tensor is first split into
its parts (q, k, v; gate, up) and each part is then sharded for the rank like a separate
checkpoint tensor. Everything else is Llama's: the config's `sliding_window` (Phi-3-mini-4k:
2047) applies to every layer, and the rope variants (longrope with short / long factors,
partial rotary for Phi-4-mini) are `ringserve.gpu.layers.rotary`'s. Registered in
`ringserve.gpu.models.registry`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ringserve.config import ModelConfig
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.models.spec import DecoderSpec


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4-mini: Llama with fused checkpoint projections and an optional window."""

    @classmethod
    def from_config(
        cls, config: ModelConfig, tp: TPGroup, backend: AttentionBackend
    ) -> LlamaForCausalLM:
        """Build the (unloaded) model for `config`.

        Raises:
            ValueError: an unsupported rope type or tensor-parallel split.
        """
        window = config.hf_config.get("sliding_window")
        spec = DecoderSpec.from_model_config(
            config, sliding_window=int(window) if window is not None else None
        )
        return cls(spec, tp, backend)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors, splitting the fused `qkv_proj` / `gate_up_proj` ones.

        Raises:
            ValueError: see `LlamaForCausalLM.load_weights`; or a fused tensor whose rows do
                not match the model's shape.
        """
        super().load_weights(self._split_fused(weights))

    def _split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        spec = self.spec
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        parts = {
            "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
            "gate_up_proj": (("gate_proj", spec.intermediate_size),
                             ("up_proj", spec.intermediate_size)),
        }
        for name, tensor in weights:
            module_name, _, param = name.rpartition(".")
            owner, _, leaf = module_name.rpartition(".")
            if leaf not in parts:
                yield name, tensor
                continue
            names, sizes = zip(*parts[leaf], strict=True)
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"checkpoint tensor {name!r}: {tensor.shape[0]} rows, expected "
                                 f"{sum(sizes)} ({' + '.join(map(str, sizes))})")
            offset = 0
            for part, size in zip(names, sizes, strict=True):
                yield f"{owner}.{part}.{param}", tensor.narrow(0, offset, size)
                offset += size
