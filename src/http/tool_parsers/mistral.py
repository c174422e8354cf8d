"""`mistral`: Mistral / Mixtral tool calls.

The model writes `[TOOL_CALLS]` (a special token, so the request keeps special tokens) and
then a JSON array of `{"name": ..., "arguments": {...}}` objects. Text before the marker is
content; everything after it is calls.
"""

from __future__ import annotations

from ringserve.http.tool_parsers.base import ContentOut, MarkerScan, ParsedDelta, ToolParser
from ringserve.http.tool_parsers.json_calls import CallScanner

TOOL_CALLS = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS]` and a JSON array of calls."""

    name = "mistral"
    needs_special_tokens = True

    def __init__(self) -> None:
        self._marker = MarkerScan(TOOL_CALLS)
        self._inside = False
        self._content = ContentOut()
        self._calls = CallScanner()

    @property
    def made_calls(self) -> bool:
        return self._calls.next_index > 0

    def feed(self, text: str) -> ParsedDelta:
        if self._inside:
            return ParsedDelta(tool_calls=self._calls.feed(text))
        before, rest = self._marker.feed(text)
        out = ParsedDelta(content=self._content.add(before))
        if rest is not None:
            self._content.drop()
            self._inside = True
            out.tool_calls = self._calls.feed(rest)
        return out

    def finish(self) -> ParsedDelta:
        if self._inside:
            return ParsedDelta(tool_calls=self._calls.end())
        out = ParsedDelta(content=self._content.add(self._marker.flush()))
        out.content += self._content.finish(self.made_calls)
        return out
