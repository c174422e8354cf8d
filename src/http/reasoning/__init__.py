"""Reasoning parsers: the model's thinking split from its answer, into the message's
`reasoning` field (the name current vLLM sends; it dropped `reasoning_content`).

`--reasoning-parser NAME` (an engine flag, since the engine core starts the structured-output
constraint where the reasoning ends) picks one of `REASONING_PARSERS`; the chat route makes
one per choice.
"""

from __future__ import annotations

from ringserve.http.reasoning.base import ReasoningParser
from ringserve.http.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


def make_reasoning_parser(name: str, prompt: str = "") -> ReasoningParser:
    """A fresh parser for one choice.

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser: got {name!r}, allowed: "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name](prompt)
