"""Architecture name (config.json `architectures`) -> model class.

The loader (`ringserve.gpu.weights.loader`) asks here for the class of a model directory's
architecture; an unknown one fails with the list of supported architectures.
"""

from __future__ import annotations

from ringserve.checkpoint.support import DECODER_BASE_ARCHITECTURES, POOLING_ONLY_ARCHITECTURES
from ringserve.config import SUPPORTED_ARCHITECTURES
from ringserve.gpu.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.models.mistral import MistralForCausalLM
from ringserve.gpu.models.moe import (
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from ringserve.gpu.models.phi3 import Phi3ForCausalLM
from ringserve.gpu.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from ringserve.gpu.multimodal.models import VISION_MODEL_CLASSES

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}
# Vision-language models (`ringserve.gpu.multimodal`): the text model with its tower.
MODEL_CLASSES.update(VISION_MODEL_CLASSES)
# A decoder saved as its base model (pooling only) runs as its causal-LM class, LM head tied.
MODEL_CLASSES.update({base: MODEL_CLASSES[causal]
                      for base, causal in DECODER_BASE_ARCHITECTURES.items()})
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES) - set(POOLING_ONLY_ARCHITECTURES)


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class implementing `architecture`.

    Raises:
        ValueError: the architecture is not supported (the message lists those that are).
    """
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(sorted(MODEL_CLASSES))}"
        ) from None
