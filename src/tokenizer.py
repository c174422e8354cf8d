"""Loading the model's tokenizer: one way for every process that needs it.

The frontends (`LLMEngine`, `AsyncLLM`) tokenize and detokenize with it; the engine core's
structured-output manager compiles grammars against its vocabulary. Both read it here, so the
core needs nothing of the frontend. transformers is imported on the first call only.
"""

from __future__ import annotations

from typing import Any

from ringserve.config import EngineConfig


def load_tokenizer(config: EngineConfig) -> Any:
    """The model's transformers tokenizer (local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.model_config.tokenizer, local_files_only=True)
