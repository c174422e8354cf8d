"""Mistral: the Llama decoder, with the config's sliding window on every layer.

Registered in `ringserve.gpu.models.registry`. Mistral checkpoints from v0.2 on have no sliding
window; v0.1's 4096-token window is applied by the attention backends (every block is kept).
"""

from __future__ import annotations

from ringserve.config import ModelConfig
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.models.spec import DecoderSpec


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral (a sliding window when the config has one)."""

    @classmethod
    def from_config(
        cls, config: ModelConfig, tp: TPGroup, backend: AttentionBackend
    ) -> LlamaForCausalLM:
        """Build the (unloaded) model for `config`."""
        window = config.hf_config.get("sliding_window")
        return cls(DecoderSpec.from_model_config(
            config, sliding_window=window if isinstance(window, int) and window > 0 else None
        ), tp, backend)
