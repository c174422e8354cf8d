"""`llama3_json`: Llama 3.1 / 3.2 JSON tool calls.

The reply is tool calls when it starts (after whitespace) with `{`, or `<|python_tag|>` and
then `{`: one or more `{"name": ..., "parameters": {...}}` objects separated by `;`. Any
other reply is content, as it comes (the python tag's code too). A reply that starts with `{` but whose first object turns out to have
no `name` (the user asked for JSON, not a call) is content too: the text is held until the
first object's name is known, which a call writes first.
"""

from __future__ import annotations

from ringserve.http.tool_parsers.base import ParsedDelta, ToolParser
from ringserve.http.tool_parsers.json_calls import CallScanner

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """Llama 3's JSON tool calls."""

    name = "llama3_json"

    def __init__(self) -> None:
        self._mode = "start"  # start, probe (held until the first name), calls, content
        self._held = ""
        self._calls = CallScanner()

    @property
    def made_calls(self) -> bool:
        return self._calls.next_index > 0

    def feed(self, text: str) -> ParsedDelta:
        if self._mode == "content":
            return ParsedDelta(content=text)
        if self._mode == "calls":
            return ParsedDelta(tool_calls=self._calls.feed(text))
        self._held += text
        if self._mode == "start":
            head = self._held.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return ParsedDelta()
            body = head[len(PYTHON_TAG):] if head.startswith(PYTHON_TAG) else head
            if not body.strip():
                return ParsedDelta()
            if not body.lstrip().startswith("{"):
                return self._to_content()  # prose, or the python tag's code
            self._mode = "probe"
            return self._probe(body)
        return self._probe(text)

    def _probe(self, text: str) -> ParsedDelta:
        deltas = self._calls.feed(text)
        if self.made_calls:
            self._mode, self._held = "calls", ""
            return ParsedDelta(tool_calls=deltas)
        if not self._calls.in_call:  # the first object closed without a name
            return self._to_content()
        return ParsedDelta()

    def _to_content(self) -> ParsedDelta:
        self._mode = "content"
        held, self._held = self._held, ""
        return ParsedDelta(content=held)

    def finish(self) -> ParsedDelta:
        if self._mode == "calls":
            return ParsedDelta(tool_calls=self._calls.end())
        if self._mode in ("start", "probe"):
            self._calls.end()
            return self._to_content()
        return ParsedDelta()
