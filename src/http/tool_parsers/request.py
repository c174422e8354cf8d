"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked and turned into
a `ToolPlan`: the constraint the engine enforces and the parser each choice's text goes
through.

- no tools, or `tool_choice: "none"`: no constraint, no parsing (the tools still reach the
  chat template, as vLLM does by default).
- `"auto"` (the default when tools are given): the `--tool-call-parser` reads the calls out
  of free text; without `--enable-auto-tool-choice --tool-call-parser` it is vLLM's 400.
- `"required"`: a JSON schema for an array (at least one item; exactly one without
  parallel_tool_calls) of `{"name": <a tool's name>, "parameters": <that tool's schema>}`.
- a named function: that function's parameters schema; the reply is its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringserve.http.errors import APIError, bad_request
from ringserve.http.protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from ringserve.http.tool_parsers import TOOL_PARSERS, make_tool_parser
from ringserve.http.tool_parsers.base import ToolParser
from ringserve.http.tool_parsers.forced import NamedToolParser, RequiredToolParser
from ringserve.sampling_params import StructuredOutputsParams

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for generation.

    Attributes:
        mode: "none", "auto", "required" or "named".
        tools: the tools as the chat template takes them (None: no tools).
        constraint: the JSON schema constraint of "required" and "named".
        parser_name: the auto parser (`--tool-call-parser`).
        function: the named function.
        parallel: more than one call is allowed (else calls after the first are dropped).
    """

    mode: str = "none"
    tools: list[dict[str, Any]] | None = None
    constraint: StructuredOutputsParams | None = None
    parser_name: str | None = None
    function: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """The replies go through a tool parser."""
        return self.mode != "none"

    @property
    def needs_special_tokens(self) -> bool:
        """The auto parser's markup is a special token the text must keep."""
        return (self.mode == "auto" and self.parser_name is not None
                and TOOL_PARSERS[self.parser_name].needs_special_tokens)

    def parser(self) -> ToolParser:
        """A fresh parser for one choice (only when `parses`)."""
        if self.mode == "required":
            return RequiredToolParser()
        if self.mode == "named":
            assert self.function is not None
            return NamedToolParser(self.function)
        assert self.parser_name is not None
        return make_tool_parser(self.parser_name)


def _check_tools(tools: list[ToolDefinition]) -> dict[str, ToolDefinition]:
    by_name: dict[str, ToolDefinition] = {}
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise bad_request(f"tools[{i}].type: got {tool.type!r}, allowed: function",
                              f"tools[{i}].type")
        name = tool.function.name
        if not name:
            raise bad_request(f"tools[{i}].function.name: got an empty name, allowed: a "
                              "function name", f"tools[{i}].function.name")
        if name in by_name:
            raise bad_request(f"tools[{i}].function.name: {name!r} is given twice; allowed: "
                              "distinct names", f"tools[{i}].function.name")
        by_name[name] = tool
    return by_name


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or _EMPTY_PARAMETERS


def required_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """The JSON schema of `tool_choice: "required"`: an array of calls of the given tools."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                             "parameters": _parameters(tool)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _named(choice: NamedToolChoice, by_name: dict[str, ToolDefinition]) -> str:
    if choice.type != "function":
        raise bad_request(f"tool_choice.type: got {choice.type!r}, allowed: function",
                          "tool_choice.type")
    name = choice.function.name
    if name not in by_name:
        raise bad_request(f"tool_choice: function {name!r} is not in tools; allowed: "
                          f"{', '.join(repr(n) for n in by_name)}", "tool_choice")
    return name


def plan_tools(req: ChatCompletionRequest, *, enable_auto_tool_choice: bool,
               tool_call_parser: str | None) -> ToolPlan:
    """The request's tool plan.

    Raises:
        APIError: 400 naming the field: a malformed tool, an unknown `tool_choice`, one
            naming a tool not in `tools`, `tool_choice` without tools, "auto" without the
            server's flags, or "required" / a named function with `response_format` or
            `structured_outputs` (both constrain the output).
    """
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice is None or choice == "none":
            return ToolPlan()
        raise bad_request("tool_choice: only with tools (give `tools`, or leave tool_choice "
                          "out)", "tool_choice")
    by_name = _check_tools(tools)
    as_dicts = [{"type": "function", "function": _function_dict(t)} for t in tools]
    parallel = req.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        if not (enable_auto_tool_choice and tool_call_parser):
            raise APIError(400, AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolPlan("auto", as_dicts, parser_name=tool_call_parser, parallel=parallel)
    if choice == "none":
        return ToolPlan("none", as_dicts)
    if isinstance(choice, str) and choice != "required":
        raise bad_request(f"tool_choice: got {choice!r}, allowed: none, auto, required or "
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
    fmt = req.response_format
    if req.structured_outputs is not None or (fmt is not None and fmt.type != "text"):
        raise bad_request("tool_choice: a required or named tool choice constrains the "
                          "output, so it cannot be combined with response_format or "
                          "structured_outputs", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = _named(choice, by_name)
        constraint = StructuredOutputsParams(json=_parameters(by_name[name]),
                                             disable_any_whitespace=True)
        return ToolPlan("named", as_dicts, constraint, function=name, parallel=False)
    constraint = StructuredOutputsParams(json=required_schema(tools, parallel),
                                         disable_any_whitespace=True)
    return ToolPlan("required", as_dicts, constraint, parallel=parallel)


def _function_dict(tool: ToolDefinition) -> dict[str, Any]:
    function = tool.function
    out: dict[str, Any] = {"name": function.name}
    if function.description is not None:
        out["description"] = function.description
    out["parameters"] = _parameters(tool)
    if function.strict is not None:
        out["strict"] = function.strict
    return out
