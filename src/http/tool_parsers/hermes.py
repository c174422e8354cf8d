"""`hermes`: Qwen2.5 / Qwen3 (and Hermes 2 Pro) tool calls.

The model writes each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
possibly several in a row, possibly after some text. Text outside the blocks is content (the
whitespace around the blocks is not); the JSON inside goes to the call scanner. A block cut
short by the end of the text keeps what was read.
"""

from __future__ import annotations

from ringserve.http.tool_parsers.base import ContentOut, MarkerScan, ParsedDelta, ToolParser
from ringserve.http.tool_parsers.json_calls import CallScanner

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """`<tool_call>` JSON `</tool_call>` blocks."""

    name = "hermes"
    needs_special_tokens = True

    def __init__(self) -> None:
        self._start = MarkerScan(START)
        self._end = MarkerScan(END)
        self._inside = False
        self._content = ContentOut()
        self._calls = CallScanner()

    @property
    def made_calls(self) -> bool:
        return self._calls.next_index > 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        rest: str | None = text
        while rest is not None:
            if self._inside:
                before, rest = self._end.feed(rest)
                out.tool_calls += self._calls.feed(before)
                if rest is not None:
                    out.tool_calls += self._calls.end()
                    self._inside = False
            else:
                before, rest = self._start.feed(rest)
                out.content += self._content.add(before)
                if rest is not None:
                    self._content.drop()
                    self._inside = True
            if rest == "":
                break
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._inside:
            out.tool_calls += self._calls.feed(self._end.flush())
            out.tool_calls += self._calls.end()
        else:
            out.content += self._content.add(self._start.flush())
        out.content += self._content.finish(self.made_calls)
        return out
