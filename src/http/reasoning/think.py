"""The `<think>` parsers: `qwen3` and `deepseek_r1`.

qwen3: the reply is reasoning when it opens with `<think>` (or the chat template opened it at
the end of the prompt, as Qwen3's thinking templates do), up to `</think>`; a reply without
it (`enable_thinking: false`) is all content. deepseek_r1: the reply starts inside the
reasoning whether or not it repeats `<think>` (R1's template puts it in the prompt), up to
`</think>`; a reply that never closes it is all reasoning.
"""

from __future__ import annotations

from ringserve.http.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: thinking only when opened."""

    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: thinking from the start."""

    name = "deepseek_r1"
    starts_in_reasoning = True
