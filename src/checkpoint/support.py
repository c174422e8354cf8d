"""What a checkpoint may be: the architectures, dtypes, load formats and weight-only
quantization methods ringserve serves.

A leaf: the checkpoint readers (`ringserve.checkpoint.model_dir`) and the engine's config
(`ringserve.config`, which re-exports these) both read it, so neither imports the other for them.
"""

from __future__ import annotations

from typing import Literal

DType = Literal["float32", "bfloat16", "float16"]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    # Vision-language models (images in: `ringserve.gpu.multimodal`).
    "Gemma3ForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Idefics3ForConditionalGeneration",
    "Phi3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
)
# Served by the pooling runner only (`--runner pooling`, `ringserve.gpu.pooling.encoder`):
# bidirectional encoders and their cross-encoder heads.
POOLING_ONLY_ARCHITECTURES: tuple[str, ...] = (
    "BertModel",
    "BertForSequenceClassification",
    "XLMRobertaModel",
    "XLMRobertaForSequenceClassification",
)
# Decoders served by the pooling runner only, each by its family's causal-LM model: saved as
# their base model (no LM head; sentence-transformers and Qwen3-Embedding layouts), or with a
# classification head (`score.weight`, `ringserve.gpu.pooling.decoder`).
DECODER_BASE_ARCHITECTURES: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}
SUPPORTED_ARCHITECTURES += POOLING_ONLY_ARCHITECTURES + tuple(DECODER_BASE_ARCHITECTURES)


LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# Weight-only quantization of the linear layers at load (ringserve.gpu.layers.quant); CPU only.
QUANTIZATION_METHODS = ("int8", "int4")
# What `--quantization` takes: a method, or "gguf" (vLLM's name): each layer of a GGUF file on
# the panels of its own tensors' codes (ringserve.checkpoint.gguf_codes.layer_method), the
# default for a quantized GGUF file on CPU.
GGUF_QUANTIZATION = "gguf"
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, GGUF_QUANTIZATION)
