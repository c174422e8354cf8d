"""Tool-call parsers: what the model wrote, split into content and OpenAI's `tool_calls`.

`--tool-call-parser NAME` picks one of `TOOL_PARSERS` for `tool_choice: "auto"`; the
constrained choices ("required", a named function) use the parsers of `forced`, which need
no markup. `ringserve.http.tool_parsers.request` turns a request's `tools` and `tool_choice`
into a plan: the constraint for the engine and the parser for each choice.
"""

from __future__ import annotations

from ringserve.http.tool_parsers.base import ToolParser
from ringserve.http.tool_parsers.hermes import HermesToolParser
from ringserve.http.tool_parsers.llama3_json import Llama3JsonToolParser
from ringserve.http.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def check_tool_parser(name: str) -> str:
    """`name` if it is a known parser.

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser: got {name!r}, allowed: "
                         f"{', '.join(sorted(TOOL_PARSERS))}")
    return name


def make_tool_parser(name: str) -> ToolParser:
    """A fresh parser (one per choice of one request)."""
    return TOOL_PARSERS[check_tool_parser(name)]()
