"""`DecoderSpec`: the shape and options of a Llama-style decoder, derived from a ModelConfig.

Read once by the model constructors in this package; the per-family differences (qkv bias for
Qwen2, q/k RMSNorm for Qwen3, tied embeddings, rope variants) are flags here rather than
separate code paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ringserve.config import ModelConfig
from ringserve.gpu.layers.rotary import rope_parameters

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class DecoderSpec:
    """Everything the decoder modules need to know about the model.

    Attributes:
        vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
        head_dim: the model's shape (full, before tensor-parallel sharding).
        rms_norm_eps: RMSNorm epsilon.
        max_position: the rope table length.
        rope: rope settings (see `ringserve.gpu.layers.rotary.rope_parameters`).
        qkv_bias: q/k/v projections have biases (Qwen2, Llama with attention_bias).
        qk_norm: per-head RMSNorm on queries and keys before rope (Qwen3).
        mlp_bias: the MLP projections have biases.
        tie_word_embeddings: the LM head shares the embedding matrix.
        dtype: parameter and activation dtype.
        sliding_window: every layer attends to this many most recent positions only (Phi-3);
            None: full attention. Families with per-layer windows (Gemma) set it per layer.
        quantization: the weight-only quantization ("int8", "int4") of the linear layers
            and the LM head, "gguf" (each on the panels of its GGUF tensors' codes), "bf16"
            (a bf16 checkpoint's weights kept in bf16 panels, float32 products: not a
            quantization, `ModelConfig.weight_format`), or None; the embedding stays float.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: dict[str, Any]
    qkv_bias: bool
    qk_norm: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    dtype: torch.dtype
    sliding_window: int | None = None
    quantization: str | None = None

    @classmethod
    def from_model_config(
        cls, config: ModelConfig, *, qkv_bias: bool | None = None, qk_norm: bool = False,
        sliding_window: int | None = None,
    ) -> DecoderSpec:
        """Derive the spec; `qkv_bias` None means the config's `attention_bias`.

        Raises:
            ValueError: an unsupported rope type.
        """
        hf = config.hf_config
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position=max(int(hf.get("max_position_embeddings") or 0), config.max_model_len),
            rope=rope_parameters(hf),
            qkv_bias=bool(hf.get("attention_bias", False)) if qkv_bias is None else qkv_bias,
            qk_norm=qk_norm,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=TORCH_DTYPES[config.dtype],
            sliding_window=sliding_window,
            # A bf16 checkpoint's bf16 panels (CPU) take the layers' quantization seam.
            quantization=config.quantization or config.weight_format,
        )
