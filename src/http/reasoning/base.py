"""The reasoning parsers' base: a state machine fed text deltas that splits the model's
thinking (`<think>...</think>`) from its answer.

`feed(text)` returns the `(reasoning, content)` fragments the delta adds (what may begin a
marker is held back), `finish()` what is left at the end; `extract(text)` is the non-streamed
split, built by feeding the whole text, so streamed and plain replies agree whatever the split.
One parser serves one choice of one request; it is given the prompt, whose end tells whether
the chat template already opened the thinking block.
"""

from __future__ import annotations

from ringserve.http.tool_parsers.base import MarkerScan

START, END = "<think>", "</think>"


class ReasoningParser:
    """`<think>` reasoning `</think>` content.

    Args:
        prompt: the prompt text; one ending in `<think>` (and whitespace) starts the reply
            inside the reasoning.

    Attributes:
        name: the registry name (`--reasoning-parser`).
        starts_in_reasoning: the reply is reasoning until `</think>` even without a
            `<think>` of its own (DeepSeek-R1, whose template opens it in the prompt).
    """

    name = ""
    starts_in_reasoning = False

    def __init__(self, prompt: str = "") -> None:
        self._state = "start"  # start, reasoning, content
        self._held = ""
        self._end = MarkerScan(END)
        self._opened = self.starts_in_reasoning or prompt.rstrip().endswith(START)

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content `text` adds."""
        if self._state == "content":
            return "", text
        if self._state == "reasoning":
            return self._reasoning(text)
        self._held += text
        head = self._held.lstrip()
        if head.startswith(START):
            self._state, self._held = "reasoning", ""
            return self._reasoning(head[len(START):])
        if not head or START.startswith(head):
            return "", ""  # whitespace, or what may become <think>
        held, self._held = self._held, ""
        if self._opened:
            self._state = "reasoning"
            return self._reasoning(held)
        self._state = "content"
        return "", held

    def _reasoning(self, text: str) -> tuple[str, str]:
        before, after = self._end.feed(text)
        if after is None:
            return before, ""
        self._state = "content"
        return before, after

    def finish(self) -> tuple[str, str]:
        """What is held back when the text ends (a reply cut short in its reasoning keeps
        it as reasoning)."""
        if self._state == "reasoning":
            return self._end.flush(), ""
        if self._state == "start":
            held, self._held = self._held, ""
            return (held, "") if self._opened else ("", held)
        return "", ""

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """The non-streamed split: reasoning and content, each None when empty."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None
