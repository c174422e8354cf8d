"""`mistral`: Mistral / Mixtral tool calls, in both of the forms Mistral's tokenizers use.

The model writes `[TOOL_CALLS]` (a special token, so the request keeps special tokens), then
either (tokenizers up to v7) a JSON array of `{"name": ..., "arguments": {...}}` objects, or
(v11 and later, Mistral Small 3.1+, Devstral, Magistral) one call per marker:
`[TOOL_CALLS]name[ARGS]{...}`, several back to back, optionally with the model's call id as
`name[CALL_ID]id[ARGS]{...}`. Text before the first marker is content; everything after it is
calls. The first character after the marker that is not whitespace picks the form: `[` or
`{` is the JSON form, anything else a name.

In the v11 form a call's header goes out when its name ends (at `[ARGS]`, at `[CALL_ID]`, or
at `{` when the text was decoded without the `[ARGS]` token), then its arguments as the model
writes them, up to the next `[TOOL_CALLS]` or the end, less the whitespace around them. As
with the JSON form the arguments are the model's text, sent whether or not it parses as JSON;
a call with no arguments gets `{}`; a name cut off by the end of the text makes no call. The
call id the model may write is skipped: calls get ids of their own, as in every parser.
"""

from __future__ import annotations

from ringserve.http.tool_parsers.base import (
    ContentOut,
    MarkerScan,
    ParsedDelta,
    ToolCallDelta,
    ToolParser,
    new_call_id,
)
from ringserve.http.tool_parsers.json_calls import CallScanner

TOOL_CALLS = "[TOOL_CALLS]"
ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"
_JSON_START = "[{"

# What ends each part of a v11 call ("{" starts arguments written without [ARGS]).
_ENDS = {"name": (ARGS, CALL_ID, "{", TOOL_CALLS), "call_id": (ARGS, "{", TOOL_CALLS),
         "args": (TOOL_CALLS,), "skip": (TOOL_CALLS,)}


class NamedCalls:
    """Tool-call deltas from v11 calls (`name[ARGS]{...}` after each `[TOOL_CALLS]`), fed the
    text after the first marker in pieces."""

    def __init__(self) -> None:
        self.next_index = 0
        self._part = "name"  # name, call_id, args, or skip (a call with no name)
        self._scans = {part: MarkerScan(*ends) for part, ends in _ENDS.items()}
        self._name = ""
        self._index: int | None = None
        self._args = ContentOut()
        self._wrote_args = False
        self._out: list[ToolCallDelta] = []

    def feed(self, text: str) -> list[ToolCallDelta]:
        """The deltas `text` completes."""
        rest: str | None = text
        while rest:
            scan = self._scans[self._part]
            before, rest = scan.feed(rest)
            self._text(before)
            if scan.found is not None:
                self._marker(scan.found)
        out, self._out = self._out, []
        return out

    def end(self) -> list[ToolCallDelta]:
        """The text ends: held-back text is read as it stands and the open call closed."""
        self._text(self._scans[self._part].flush())
        self._end_call()
        out, self._out = self._out, []
        return out

    def _text(self, text: str) -> None:
        if self._part == "name":
            self._name += text
        elif self._part == "args" and self._index is not None:
            if not self._wrote_args:
                text = text.lstrip()
                self._wrote_args = bool(text)
            arguments = self._args.add(text) if text else ""
            if arguments:
                self._out.append(ToolCallDelta(self._index, arguments=arguments))

    def _marker(self, marker: str) -> None:
        if marker == TOOL_CALLS:
            self._end_call()
            self._part, self._name = "name", ""
            return
        if self._part == "name":
            name, self._name = self._name.strip(), ""
            if not name:
                self._part = "skip"
                return
            self._index, self.next_index = self.next_index, self.next_index + 1
            self._out.append(ToolCallDelta(self._index, id=new_call_id(), name=name))
        self._part = "call_id" if marker == CALL_ID else "args"
        if marker == "{":
            self._text(marker)

    def _end_call(self) -> None:
        if self._index is not None and not self._wrote_args:
            self._out.append(ToolCallDelta(self._index, arguments="{}"))
        self._index, self._wrote_args, self._args = None, False, ContentOut()


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS]` and a JSON array of calls, or `[TOOL_CALLS]name[ARGS]{...}` calls."""

    name = "mistral"
    needs_special_tokens = True

    def __init__(self) -> None:
        self._marker = MarkerScan(TOOL_CALLS)
        self._inside = False
        self._content = ContentOut()
        self._calls: CallScanner | NamedCalls | None = None

    @property
    def made_calls(self) -> bool:
        return self._calls is not None and self._calls.next_index > 0

    def feed(self, text: str) -> ParsedDelta:
        if self._inside:
            return ParsedDelta(tool_calls=self._calls_feed(text))
        before, rest = self._marker.feed(text)
        out = ParsedDelta(content=self._content.add(before))
        if rest is not None:
            self._content.drop()
            self._inside = True
            out.tool_calls = self._calls_feed(rest)
        return out

    def finish(self) -> ParsedDelta:
        if self._inside:
            return ParsedDelta(tool_calls=[] if self._calls is None else self._calls.end())
        out = ParsedDelta(content=self._content.add(self._marker.flush()))
        out.content += self._content.finish(self.made_calls)
        return out

    def _calls_feed(self, text: str) -> list[ToolCallDelta]:
        """Text after the first marker, to the reader of its form (picked at its first
        character that is not whitespace)."""
        if self._calls is None:
            text = text.lstrip()
            if not text:
                return []
            self._calls = CallScanner() if text[0] in _JSON_START else NamedCalls()
        return self._calls.feed(text)
