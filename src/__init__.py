"""ringserve: an LLM inference and serving engine on trio and lock-free shared-memory rings.

Public API (more arrives as the engine is built; see README.md for what exists today):
`LLM`, `LLMEngine`, `AsyncLLM`, `SamplingParams`, `RequestOutputKind`, `RequestOutput`, `CompletionOutput`,
`EngineArgs`, `StructuredOutputsParams`, `LoRARequest`, `PoolingParams`.
Importing `ringserve` imports neither torch nor transformers.
"""

from ringserve.engine.arg_utils import EngineArgs
from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.engine.frontend.llm import LLM
from ringserve.engine.frontend.llm_engine import LLMEngine
from ringserve.lora_request import LoRARequest
from ringserve.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    WeightVersionSpan,
)
from ringserve.pooling_params import PoolingParams
from ringserve.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    SamplingType,
    StructuredOutputsParams,
)

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "PoolingParams",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingType",
    "StructuredOutputsParams",
    "WeightVersionSpan",
    "__version__",
]
