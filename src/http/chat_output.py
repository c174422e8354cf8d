"""A chat choice's text, split into OpenAI's message fields: reasoning, content, tool calls.

The text goes through the reasoning parser (when the engine runs one) and what it leaves as
content through the request's tool parser (when tools are parsed); a `ChoiceOutput` does
both for one choice, streamed (`feed` per text delta, then `finish`) or whole (`message`),
and the two say the same, since the whole text is one feed. Used by the chat route; the
parsers live in `ringserve.http.reasoning` and `ringserve.http.tool_parsers`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.http.reasoning import make_reasoning_parser
from ringserve.http.reasoning.base import ReasoningParser
from ringserve.http.responses import (
    ChatMessageOut,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from ringserve.http.tool_parsers.base import ToolCallDelta, ToolParser, merge_calls
from ringserve.http.tool_parsers.request import ToolPlan


@dataclass
class ChoiceDelta:
    """What a text delta of one choice became."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ChoiceDelta) -> None:
        """Append `other`."""
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls

    def delta(self) -> DeltaMessage:
        """The stream chunk's delta (empty fields left out)."""
        calls = [DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                               function=DeltaFunction(name=d.name, arguments=d.arguments))
                 for d in self.tool_calls]
        return DeltaMessage(content=self.content or None, reasoning=self.reasoning or None,
                            tool_calls=calls or None)


@dataclass(frozen=True)
class ChatOutputPlan:
    """How a request's choices are parsed.

    Attributes:
        reasoning_parser: the engine's `--reasoning-parser` (None: no reasoning split).
        tools: the request's tool plan.
        prompt: the rendered prompt (its end tells whether thinking is already open).
    """

    reasoning_parser: str | None
    tools: ToolPlan
    prompt: str

    @property
    def parses(self) -> bool:
        """Some parsing happens (else the text is content as it comes)."""
        return self.reasoning_parser is not None or self.tools.parses

    def choice(self) -> ChoiceOutput:
        """A fresh pipeline for one choice."""
        reasoning = (None if self.reasoning_parser is None
                     else make_reasoning_parser(self.reasoning_parser, self.prompt))
        tools = self.tools.parser() if self.tools.parses else None
        return ChoiceOutput(reasoning, tools, self.tools.parallel)


class ChoiceOutput:
    """One choice's reasoning and tool parsing.

    Args:
        reasoning: the reasoning parser, or None.
        tools: the tool parser, or None.
        parallel: keep every call (else only the first).
    """

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
                 parallel: bool = True) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.parallel = parallel
        self.made_calls = False

    def feed(self, text: str) -> ChoiceDelta:
        """What the next text delta adds."""
        reasoning, content = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        return self._content(reasoning, content, final=False)

    def finish(self) -> ChoiceDelta:
        """What is left when the choice ends."""
        reasoning, content = ("", "") if self.reasoning is None else self.reasoning.finish()
        return self._content(reasoning, content, final=True)

    def _content(self, reasoning: str, content: str, *, final: bool) -> ChoiceDelta:
        out = ChoiceDelta(reasoning=reasoning)
        if self.tools is None:
            out.content = content
            return out
        parsed = self.tools.feed(content)
        if final:
            parsed.extend(self.tools.finish())
        out.content = parsed.content
        out.tool_calls = [d for d in parsed.tool_calls if self.parallel or d.index == 0]
        self.made_calls = self.made_calls or bool(out.tool_calls)
        return out

    def message(self, text: str, role: str, echo: str = "") -> ChatMessageOut:
        """The non-streamed message of the whole text (`echo` goes before the content)."""
        out = self.feed(text)
        out.extend(self.finish())
        calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                 for c in merge_calls(out.tool_calls)]
        content = echo + out.content
        empty = None if calls or out.reasoning else ""
        return ChatMessageOut(role=role, content=content or empty,
                              reasoning=out.reasoning or None, tool_calls=calls)

    def finish_reason(self, reason: str | None) -> str | None:
        """`tool_calls` once calls were made and the model stopped by itself."""
        return "tool_calls" if self.made_calls and reason == "stop" else reason
