"""Qwen2 and Qwen3: the Llama decoder with qkv bias (Qwen2) or per-head q/k RMSNorm (Qwen3).

Registered in `ringserve.gpu.models.registry`; everything else (weights layout, rope, GQA, tied
embeddings) is shared with `ringserve.gpu.models.llama`.
"""

from __future__ import annotations

from ringserve.config import ModelConfig
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.models.spec import DecoderSpec


def _refuse_layer_windows(config: ModelConfig) -> None:
    """Qwen2/3 configs with `use_sliding_window` window only the layers from
    `max_window_layers` on; that per-layer mix is not built here, so it is refused rather
    than run with full attention."""
    types = config.hf_config.get("layer_types") or []
    if config.hf_config.get("use_sliding_window") and "sliding_attention" in types:
        raise ValueError(f"{config.architecture}: use_sliding_window (sliding attention on "
                         "layers past max_window_layers) is not supported; released Qwen2/3 "
                         "checkpoints set it false")


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: q/k/v projections always carry a bias."""

    @classmethod
    def from_config(
        cls, config: ModelConfig, tp: TPGroup, backend: AttentionBackend
    ) -> LlamaForCausalLM:
        """Build the (unloaded) model for `config`."""
        _refuse_layer_windows(config)
        return cls(DecoderSpec.from_model_config(config, qkv_bias=True), tp, backend)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: RMSNorm on each query and key head before rope; bias per `attention_bias`."""

    @classmethod
    def from_config(
        cls, config: ModelConfig, tp: TPGroup, backend: AttentionBackend
    ) -> LlamaForCausalLM:
        """Build the (unloaded) model for `config`."""
        _refuse_layer_windows(config)
        return cls(DecoderSpec.from_model_config(config, qk_norm=True), tp, backend)
