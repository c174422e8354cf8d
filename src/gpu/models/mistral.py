"""Mistral: the Llama decoder; a sliding window shorter than the context is refused.

Registered in `ringserve.gpu.models.registry`. Mistral checkpoints from v0.2 on have no sliding
window; v0.1's 4096-token window is only exact here while `max_model_len` stays within it.
"""

from __future__ import annotations

from ringserve.config import ModelConfig
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.models.spec import DecoderSpec
from ringserve.gpu.parallel import TPGroup


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral (full attention)."""

    @classmethod
    def from_config(
        cls, config: ModelConfig, tp: TPGroup, backend: AttentionBackend
    ) -> LlamaForCausalLM:
        """Build the (unloaded) model for `config`.

        Raises:
            ValueError: the model uses a sliding window shorter than `max_model_len`.
        """
        window = config.hf_config.get("sliding_window")
        if isinstance(window, int) and window < config.max_model_len:
            raise ValueError(
                f"sliding_window {window} < max_model_len {config.max_model_len}: sliding-window "
                f"attention is not supported; pass max_model_len <= {window}"
            )
        return cls(DecoderSpec.from_model_config(config), tp, backend)
