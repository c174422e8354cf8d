"""Streaming tool calls out of JSON call objects, one character at a time.

Every parser's calls are JSON objects `{"name": ..., "arguments": ...}` (`parameters` for
Llama 3 and the `required` constraint), alone, in an array or separated by `;`.
`CallScanner` follows the JSON (nesting depth, strings and escapes) without building it: the
call's header (index, id, name) goes out as soon as its `name` string is complete, then the
`arguments` value goes out as the model writes it, verbatim (so the arguments are the JSON
text the model wrote; a value written as a JSON string is sent decoded, once complete).
Outside call objects, brackets, commas, semicolons and anything else are skipped. The first
`name` and the first arguments key of an object count; an object with no string `name` is
not a call and sends nothing; a call with no arguments gets `{}`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from ringserve.http.tool_parsers.base import ToolCallDelta, new_call_id

ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\r\n"


@dataclass
class _Call:
    """The call object being read."""

    name: str | None = None
    index: int | None = None  # set when the header went out
    pending: str = ""  # argument text read before the name was known
    seen_args: bool = False


@dataclass
class _Value:
    """A value directly inside the call object."""

    role: str  # "name", "args" or "other"
    kind: str  # "string", "container" or "scalar"
    raw: list[str] = field(default_factory=list)  # a string's text, quotes included


class CallScanner:
    """Tool-call deltas from the JSON text of call objects, fed in pieces.

    Args:
        first_index: the index of the first call (calls are numbered in order).
        make_id: the id of each call.
    """

    def __init__(self, first_index: int = 0, make_id: Callable[[], str] = new_call_id) -> None:
        self.next_index = first_index
        self.make_id = make_id
        self.out: list[ToolCallDelta] = []
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.expect = "key"  # inside the call object: key, colon, value, comma
        self.key_raw: list[str] | None = None
        self.member: str | None = None
        self.value: _Value | None = None
        self.call: _Call | None = None

    @property
    def in_call(self) -> bool:
        """A call object is open."""
        return self.depth > 0

    def feed(self, text: str) -> list[ToolCallDelta]:
        """The deltas `text` completes (argument fragments of one call merged)."""
        for c in text:
            self._char(c)
        out, self.out = self.out, []
        return _merged(out)

    def end(self) -> list[ToolCallDelta]:
        """The text ends (or its block does): an open call is closed as it stands."""
        if self.depth > 0:
            self._end_call()
        self.depth, self.in_str, self.esc = 0, False, False
        out, self.out = self.out, []
        return _merged(out)

    # -- the character machine -----------------------------------------------------------

    def _char(self, c: str) -> None:
        if self.depth == 0:
            if c == "{":
                self.depth, self.expect, self.call = 1, "key", _Call()
            return
        if self.in_str:
            self._string_char(c)
        elif c == '"':
            self._open_string(c)
        elif c in "{[":
            if self.depth == 1 and self.expect == "value":
                self._begin_value("container")
            self.depth += 1
            self._route(c)
        elif c in "}]":
            self._close(c)
        elif self.depth == 1:
            self._top_char(c)
        else:
            self._route(c)

    def _string_char(self, c: str) -> None:
        if self.esc:
            self.esc = False
        elif c == "\\":
            self.esc = True
        elif c == '"':
            self.in_str = False
        if self.key_raw is not None:
            self.key_raw.append(c)
            if not self.in_str:
                self._end_key()
            return
        self._route(c)
        if not self.in_str and self.depth == 1 and self.value is not None:
            self._end_value()

    def _open_string(self, c: str) -> None:
        self.in_str = True
        if self.depth == 1 and self.expect == "key":
            self.key_raw = [c]
            return
        if self.depth == 1 and self.expect == "value":
            self._begin_value("string")
        self._route(c)

    def _close(self, c: str) -> None:
        if self.depth == 1:
            if self.value is not None:
                self._end_value()
            self._end_call()
            self.depth = 0
            return
        self._route(c)
        self.depth -= 1
        if self.depth == 1 and self.value is not None:
            self._end_value()

    def _top_char(self, c: str) -> None:
        """A character directly inside the call object, outside strings."""
        if self.value is not None and self.value.kind == "scalar":
            if c in _WS or c == ",":
                self._end_value()
            else:
                self._route(c)
                return
        if c == ":" and self.expect == "colon":
            self.expect = "value"
        elif c == ",":
            self.expect = "key"
        elif c not in _WS and self.expect == "value":
            self._begin_value("scalar")
            self._route(c)

    # -- keys and values -----------------------------------------------------------------

    def _end_key(self) -> None:
        raw = "".join(self.key_raw or [])
        self.key_raw = None
        try:
            self.member = str(json.loads(raw))
        except ValueError:
            self.member = None
        self.expect = "colon"

    def _begin_value(self, kind: str) -> None:
        call = self.call
        assert call is not None
        role = "other"
        if self.member == "name" and call.name is None and kind == "string":
            role = "name"
        elif self.member in ARGUMENT_KEYS and not call.seen_args:
            role = "args"
            call.seen_args = True
        self.value = _Value(role, kind)
        self.expect = "comma"

    def _route(self, c: str) -> None:
        """A character of the value being read."""
        value = self.value
        if value is None or value.role == "other":
            return
        if value.role == "name" or value.kind == "string":
            value.raw.append(c)
        else:
            self._arguments(c)

    def _end_value(self) -> None:
        value, self.value = self.value, None
        if value is None or value.role == "other":
            return
        try:
            decoded = json.loads("".join(value.raw)) if value.raw else None
        except ValueError:
            decoded = None
        if value.role == "name":
            assert self.call is not None
            if isinstance(decoded, str):
                self.call.name = decoded
                self._header()
        elif value.kind == "string" and isinstance(decoded, str):
            self._arguments(decoded)

    def _arguments(self, text: str) -> None:
        call = self.call
        assert call is not None
        if call.index is None:
            call.pending += text
        else:
            self.out.append(ToolCallDelta(call.index, arguments=text))

    def _header(self) -> None:
        call = self.call
        assert call is not None and call.name is not None
        call.index = self.next_index
        self.next_index += 1
        self.out.append(ToolCallDelta(call.index, id=self.make_id(), name=call.name))
        if call.pending:
            self.out.append(ToolCallDelta(call.index, arguments=call.pending))
            call.pending = ""

    def _end_call(self) -> None:
        call, self.call = self.call, None
        self.value, self.key_raw, self.member = None, None, None
        if call is not None and call.index is not None and not call.seen_args:
            self.out.append(ToolCallDelta(call.index, arguments="{}"))


def _merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive argument fragments of one call as one delta (headers kept apart)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        last = out[-1] if out else None
        if (last is not None and d.id is None and last.id is None and last.index == d.index):
            last.arguments += d.arguments
        else:
            out.append(d)
    return out
