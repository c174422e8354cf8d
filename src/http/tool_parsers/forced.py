"""The parsers of constrained tool choices (`tool_choice` "required" or a named function).

The grammar mask makes the reply JSON, so these need no markup: for "required" the reply is
an array of `{"name": ..., "parameters": {...}}` objects (`RequiredToolParser`), for a named
function the reply is that function's arguments (`NamedToolParser`). The reply is never
content.
"""

from __future__ import annotations

from ringserve.http.tool_parsers.base import (
    ContentOut,
    ParsedDelta,
    ToolCallDelta,
    ToolParser,
    new_call_id,
)
from ringserve.http.tool_parsers.json_calls import CallScanner


class RequiredToolParser(ToolParser):
    """`tool_choice: "required"`: a JSON array of calls."""

    name = "required"

    def __init__(self) -> None:
        self._calls = CallScanner()

    @property
    def made_calls(self) -> bool:
        return self._calls.next_index > 0

    def feed(self, text: str) -> ParsedDelta:
        return ParsedDelta(tool_calls=self._calls.feed(text))

    def finish(self) -> ParsedDelta:
        return ParsedDelta(tool_calls=self._calls.end())


class NamedToolParser(ToolParser):
    """A named `tool_choice`: the reply is the function's arguments (whitespace around
    them dropped)."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function
        self._started = False
        self._args = ContentOut()

    @property
    def made_calls(self) -> bool:
        return self._started

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not self._started:
            text = text.lstrip()
            if not text:
                return out
            self._started = True
            out.tool_calls.append(ToolCallDelta(0, id=new_call_id(), name=self.function))
        fragment = self._args.add(text)
        if fragment:
            out.tool_calls.append(ToolCallDelta(0, arguments=fragment))
        return out

    def finish(self) -> ParsedDelta:
        self._args.finish(True)
        return ParsedDelta()
