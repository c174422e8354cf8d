"""The grammar-backend seam: what the engine core needs from xgrammar, llguidance or a third.

A backend is built once per engine core from the tokenizer (`create_backend`); `compile`
turns a request's `StructuredOutputsParams` into a compiled grammar (thread-safe: the core
compiles on a thread pool and caches by `StructuredOutputsParams.key()`), and `matcher` makes
one `GrammarMatcher` per request (n > 1: one per child) from a compiled grammar.

Bitmask layout (shared with the workers, which apply it to the logits): int32, shape
`[rows, ceil(vocab_size / 32)]`, bit `t % 32` of word `t // 32` set when token `t` is allowed
(xgrammar's layout; llguidance fills the same one). Tokens past the tokenizer's vocabulary up
to the model's `vocab_size` are never allowed.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ringserve.sampling_params import StructuredOutputsParams

__all__ = ["BACKENDS", "GrammarMatcher", "StructuredOutputBackend", "allocate_bitmask",
           "bitmask_words", "create_backend"]

# Backend name -> "module:Class" (a third backend is one module and one line here).
BACKENDS = {
    "xgrammar": "ringserve.engine.structured.xgrammar_backend:XgrammarBackend",
    "guidance": "ringserve.engine.structured.guidance_backend:GuidanceBackend",
}


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) when the grammar forbids it."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` (the layout above)."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar has accepted the end (EOS after a complete match)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        ...


class StructuredOutputBackend(Protocol):
    """Compiles constraints for one tokenizer and makes matchers."""

    name: str
    vocab_size: int

    def compile(self, params: StructuredOutputsParams) -> Any:
        """Compile a constraint (thread-safe; may take long: the core runs it off its loop).

        Raises:
            ValueError: the spec is invalid or uses a feature the backend cannot compile;
                the message names the field (`structured_outputs.json: ...`).
        """
        ...

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of a compiled grammar."""
        ...


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask of `rows` rows with every token allowed."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def create_backend(name: str, tokenizer: Any, vocab_size: int,
                   stop_token_ids: Sequence[int] | None = None) -> StructuredOutputBackend:
    """The backend `name` ("xgrammar" or "guidance") for a transformers tokenizer.

    Args:
        name: a key of `BACKENDS`.
        tokenizer: the model's transformers tokenizer.
        vocab_size: the model's vocabulary size (the logits' width; may exceed the
            tokenizer's).
        stop_token_ids: the ids that end generation (the model's EOS ids, from config.json
            and generation_config.json); default the tokenizer's EOS.

    Raises:
        ValueError: an unknown backend.
    """
    target = BACKENDS.get(name)
    if target is None:
        raise ValueError(f"structured outputs backend: got {name!r}, allowed: "
                         f"{', '.join(BACKENDS)}")
    module, cls = target.split(":")
    stops = None if stop_token_ids is None else list(stop_token_ids)
    backend: StructuredOutputBackend = getattr(importlib.import_module(module), cls)(
        tokenizer, vocab_size, stops)
    return backend
