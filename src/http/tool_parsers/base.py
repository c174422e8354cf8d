"""What every tool-call parser shares: the call and delta types, the base class, and the
streaming helpers (a marker search that holds back a partial marker, and content output that
drops the whitespace left around tool-call markup).

A parser is a small state machine fed text deltas (`feed`) and told when the text ends
(`finish`); each returns the `ParsedDelta` the chunk carries: a content fragment and tool-call
deltas (the first delta of a call carries its index, id and name, later ones argument
fragments). `extract(text)` is the non-streamed result, built by feeding the whole text at
once, so a streamed reply and a plain one always say the same whatever the split. One parser
serves one choice of one request.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


def new_call_id() -> str:
    """A tool call id in OpenAI's shape (`call_` + random hex)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """A piece of a tool call: the first carries `id` and `name` (arguments ""), later ones
    argument fragments only."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    """A whole tool call: `arguments` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


@dataclass
class ParsedDelta:
    """What one fed text delta became."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def extend(self, other: ParsedDelta) -> None:
        """Append `other` (its content after this one's, its calls after these)."""
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


def merge_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Whole calls from their deltas, in index order."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = ToolCall(d.id or new_call_id(), d.name or "", "")
        calls[d.index].arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (but is not all of it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class MarkerScan:
    """Finds the first of one or more markers in streamed text, holding back an end that may
    begin one of them.

    Attributes:
        found: the marker the last `feed` found (None: none).
    """

    def __init__(self, *markers: str) -> None:
        self.markers = markers
        self.held = ""
        self.found: str | None = None

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns the text before the first marker, and the text after it (None: no marker
        yet; what may begin one is held back)."""
        buf = self.held + text
        hits = [(at, -len(m), m) for m in self.markers if (at := buf.find(m)) >= 0]
        if hits:
            at, _, marker = min(hits)
            self.held, self.found = "", marker
            return buf[:at], buf[at + len(marker):]
        keep = max(partial_suffix(buf, m) for m in self.markers)
        self.held, self.found = buf[len(buf) - keep:], None
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        """The held-back text, when the stream ends without a marker."""
        held, self.held = self.held, ""
        return held


class ContentOut:
    """Content around tool calls: whitespace is held until more content follows, dropped
    where a tool call starts, and at the end dropped if any call was made (the newlines a
    model writes between its calls are not content)."""

    def __init__(self) -> None:
        self.pending = ""

    def add(self, text: str) -> str:
        """The content to send now for `text`."""
        stripped = text.rstrip()
        if not stripped:
            self.pending += text
            return ""
        out = self.pending + stripped
        self.pending = text[len(stripped):]
        return out

    def drop(self) -> None:
        """A tool call starts: the whitespace before it is not content."""
        self.pending = ""

    def finish(self, made_calls: bool) -> str:
        """The held whitespace, unless calls were made."""
        pending, self.pending = self.pending, ""
        return "" if made_calls else pending


class ToolParser(ABC):
    """The base of the tool-call parsers: subclasses implement `feed` and `finish`.

    Attributes:
        name: the registry name (`--tool-call-parser`).
        needs_special_tokens: the markup is a special token, so the request must keep
            special tokens in its text (vLLM's `adjust_request`).
    """

    name = ""
    needs_special_tokens = False

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """What the next text delta adds."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """What is left when the text ends (held-back content, a call cut short)."""

    @property
    @abstractmethod
    def made_calls(self) -> bool:
        """At least one tool call was started."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The non-streamed result: content (None when empty) and whole tool calls."""
        out = self.feed(text)
        out.extend(self.finish())
        return out.content or None, merge_calls(out.tool_calls)
