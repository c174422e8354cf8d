"""A Messages request in the chat route's terms: the `ChatCompletionRequest` `turn` runs.

`chat_request(req)` maps Anthropic's fields onto the chat route's, so the prompt is the one
the chat route builds for the same conversation:

- `system` (a string or text blocks) becomes the first message, role `system`, its blocks
  text parts (the chat template joins them with newlines). Claude Code's attribution line
  (`x-anthropic-billing-header: ...; cch=<hash>;`, a per-request hash) is removed when it is
  the system prompt's first line, with its line break, and so is a text block it leaves
  empty, so consecutive turns share their prefix in the cache; an empty system prompt adds
  no message.
- user messages: text and image blocks become a user message (text and image parts; a
  base64 `source` a data: URL, rendered by `ringserve.http.chat_images`, whose errors name
  the block: `messages[0].content[1]: ...`), each `tool_result` a `tool`
  message answering `tool_use_id` (its text blocks joined with newlines; `is_error: true`
  puts `Error: ` before the text), in block order; the id must name a `tool_use` of an
  earlier assistant message.
- assistant messages: text blocks become the content, `tool_use` blocks `tool_calls` (the
  input as JSON text), `thinking` blocks the message's `reasoning` (joined with newlines);
  `redacted_thinking` has no text and is left out. A conversation that ends with an
  assistant message is continued (Anthropic's prefill: `continue_final_message`).
- `tools` become function tools (`input_schema` the parameters); `tool_choice` `auto`,
  `any`, `tool` and `none` become `auto`, `required`, the named function and `none`, and
  `disable_parallel_tool_use` `parallel_tool_calls: false`.
- `thinking` `enabled` / `adaptive` / `disabled` set the template's `enable_thinking`;
  `output_config.format` is the chat route's `json_schema` response format.
- `max_tokens` is not passed on: the route caps the output at the room the context leaves.

Every refusal is a 400 naming Anthropic's field: an image source without its data, an image
inside a `tool_result` (not supported yet), a block
in the wrong role's message, a tool that is not a client tool, a `tool_choice` naming an
absent tool, a `tool_result` for no call, a thinking budget out of Anthropic's range.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from ringserve.http.agents.messages_protocol import (
    MIN_THINKING_BUDGET,
    ImageBlock,
    InputBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    Tool,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolResultBlock,
    ToolUseBlock,
)
from ringserve.http.errors import APIError, bad_request
from ringserve.http.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    ImageURL,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolCallIn,
    ToolDefinition,
)

T = TypeVar("T")

BILLING_PREFIX = "x-anthropic-billing-header:"
ERROR_PREFIX = "Error: "
# The media types of Anthropic's base64 image sources.
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def strip_billing_line(text: str) -> str:
    """`text` without a first line that is Claude Code's attribution line (with its line
    break)."""
    if not text.startswith(BILLING_PREFIX):
        return text
    return text.partition("\n")[2]


def _parts(texts: list[str]) -> list[ContentPart]:
    return [ContentPart(type="text", text=text) for text in texts]


def _system(system: str | list[TextBlock] | None) -> list[ChatMessage]:
    if system is None:
        return []
    if isinstance(system, str):
        text = strip_billing_line(system)
        return [ChatMessage(role="system", content=text)] if text else []
    texts = [block.text for block in system]
    if texts and texts[0].startswith(BILLING_PREFIX):
        first = strip_billing_line(texts[0])
        texts = ([first] if first else []) + texts[1:]
    return [ChatMessage(role="system", content=_parts(texts))] if texts else []


def _refuse(block: InputBlock, where: str, role: str) -> APIError:
    kind = type(block).__struct_config__.tag
    belongs = "an assistant" if role == "user" else "a user"
    return bad_request(f"{where}: a {kind} block belongs in {belongs} message, not in this "
                       f"{role} message", where)


def _image_url(block: ImageBlock, where: str) -> str:
    """An image block's source as an image URL (base64 data becomes a data: URL).

    Raises:
        APIError: 400 naming the source's missing or unknown field.
    """
    source = block.source
    if source.type == "base64":
        if source.media_type not in IMAGE_MEDIA_TYPES:
            raise bad_request(f"{where}.source.media_type: got {source.media_type!r}, allowed: "
                              f"{', '.join(IMAGE_MEDIA_TYPES)}", f"{where}.source.media_type")
        if source.data is None or source.url is not None:
            raise bad_request(f"{where}.source.data: required (alone) in a base64 source",
                              f"{where}.source.data")
        return f"data:{source.media_type};base64,{source.data}"
    if source.type == "url":
        if source.url is None or source.data is not None or source.media_type is not None:
            raise bad_request(f"{where}.source.url: required (alone) in a url source",
                              f"{where}.source.url")
        return source.url
    raise bad_request(f"{where}.source.type: got {source.type!r}, allowed: base64, url",
                      f"{where}.source.type")


def _tool_text(block: ToolResultBlock, where: str) -> str:
    if isinstance(block.content, str):
        text = block.content
    else:
        texts = []
        for k, part in enumerate(block.content):
            if isinstance(part, ImageBlock):
                raise bad_request(f"{where}.content[{k}]: image blocks are not supported yet; "
                                  "allowed: text", f"{where}.content[{k}]")
            texts.append(part.text)
        text = "\n".join(texts)
    return ERROR_PREFIX + text if block.is_error else text


def _user(blocks: list[InputBlock], where: str, calls: set[str], *, first: int,
          locations: dict[str, str]) -> list[ChatMessage]:
    """A user message's blocks as chat messages, the first of them at index `first` of the
    chat messages; each image part's chat location is mapped to its block in `locations`."""
    out: list[ChatMessage] = []
    parts: list[ContentPart] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if isinstance(block, TextBlock):
            parts.append(ContentPart(type="text", text=block.text))
        elif isinstance(block, ImageBlock):
            locations[f"messages[{first + len(out)}].content[{len(parts)}]"] = at
            parts.append(ContentPart(type="image_url",
                                     image_url=ImageURL(url=_image_url(block, at))))
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in calls:
                raise bad_request(f"{at}.tool_use_id: {block.tool_use_id!r} matches no tool_use "
                                  "block of an earlier assistant message", f"{at}.tool_use_id")
            if parts:
                out.append(ChatMessage(role="user", content=parts))
                parts = []
            out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id,
                                   content=_tool_text(block, at)))
        else:
            raise _refuse(block, at, "user")
    if parts or not out:
        out.append(ChatMessage(role="user", content=parts))
    return out


def _assistant(blocks: list[InputBlock], where: str, calls: set[str]) -> ChatMessage:
    texts: list[str] = []
    reasoning: list[str] = []
    tool_calls: list[ToolCallIn] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.add(block.id)
            arguments = msgspec.json.encode(block.input).decode()
            tool_calls.append(ToolCallIn(id=block.id, function=FunctionCall(
                name=block.name, arguments=arguments)))
        elif not isinstance(block, RedactedThinkingBlock):
            raise _refuse(block, f"{where}.content[{j}]", "assistant")
    return ChatMessage(role="assistant", content=_parts(texts) if texts else None,
                       tool_calls=tool_calls or None,
                       reasoning="\n".join(reasoning) if reasoning else None)


def chat_messages(req: MessagesRequest,
                  locations: dict[str, str] | None = None) -> list[ChatMessage]:
    """The conversation as chat messages (the system prompt first).

    Args:
        locations: filled with each image part's chat location (`messages[2].content[0]`)
            and the block it came from (`messages[1].content[1]`), for the image errors.

    Raises:
        APIError: 400 naming the block: an image source without its data, a block in the
            wrong role's message, a tool_result whose id matches no earlier tool_use.
    """
    out = _system(req.system)
    calls: set[str] = set()
    names = locations if locations is not None else {}
    for i, message in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(message.content, str):
            out.append(ChatMessage(role=message.role, content=message.content))
        elif message.role == "assistant":
            out.append(_assistant(message.content, where, calls))
        else:
            out.extend(_user(message.content, where, calls, first=len(out), locations=names))
    return out


def _convert(value: Any, kind: type[T], where: str) -> T:
    """`msgspec.convert`, its error's path placed under `where`."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        text = text.replace("`$", f"`$.{where}") if "`$" in text else f"{text} - at `$.{where}`"
        raise bad_request(f"Invalid request body: {text}", where) from None


def chat_tools(tools: list[dict[str, Any]]) -> list[ToolDefinition]:
    """Client tools as function tools.

    Raises:
        APIError: 400 naming the tool's field: a server tool (a `type` other than custom), a
            malformed tool, an empty or repeated name.
    """
    out: list[ToolDefinition] = []
    names: set[str] = set()
    for i, item in enumerate(tools):
        where = f"tools[{i}]"
        kind = item.get("type")
        if kind not in (None, "custom"):
            raise bad_request(f"{where}.type: got {kind!r}, allowed: custom (a client tool with "
                              "name and input_schema; server tools are not supported)",
                              f"{where}.type")
        tool = _convert(item, Tool, where)
        if not tool.name:
            raise bad_request(f"{where}.name: got an empty name, allowed: a tool name",
                              f"{where}.name")
        if tool.name in names:
            raise bad_request(f"{where}.name: {tool.name!r} is given twice; allowed: distinct "
                              "names", f"{where}.name")
        names.add(tool.name)
        out.append(ToolDefinition(function=FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.input_schema,
            strict=tool.strict)))
    return out


def _tool_choice(req: MessagesRequest, names: list[str]) -> tuple[str | NamedToolChoice | None,
                                                                   bool]:
    """The chat route's `tool_choice` and `parallel_tool_calls`."""
    choice = req.tool_choice
    if choice is None:
        return None, True
    if isinstance(choice, ToolChoiceNone):
        return "none", True
    parallel = not choice.disable_parallel_tool_use
    if isinstance(choice, ToolChoiceAuto):
        return ("auto" if names else None), parallel
    if not names:
        raise bad_request(f"tool_choice: type {type(choice).__struct_config__.tag!r} needs "
                          "tools (give `tools`, or leave tool_choice out)", "tool_choice")
    if isinstance(choice, ToolChoiceAny):
        return "required", parallel
    if choice.name not in names:
        raise bad_request(f"tool_choice.name: {choice.name!r} is not in tools; allowed: "
                          f"{', '.join(repr(n) for n in names)}", "tool_choice.name")
    return NamedToolChoice(function=NamedFunction(name=choice.name)), False


def _template_kwargs(req: MessagesRequest) -> dict[str, Any] | None:
    thinking = req.thinking
    if thinking is None:
        return None
    if isinstance(thinking, ThinkingEnabled):
        budget = thinking.budget_tokens
        limit = "" if req.max_tokens is None else f" and less than max_tokens ({req.max_tokens})"
        if budget < MIN_THINKING_BUDGET or (req.max_tokens is not None
                                            and budget >= req.max_tokens):
            raise bad_request(f"thinking.budget_tokens: got {budget}, allowed: at least "
                              f"{MIN_THINKING_BUDGET}{limit}", "thinking.budget_tokens")
    return {"enable_thinking": not isinstance(thinking, ThinkingDisabled)}


def _response_format(req: MessagesRequest, tool_choice: object) -> ResponseFormat | None:
    config = req.output_config
    if config is None or config.format is None:
        return None
    if tool_choice == "required" or isinstance(tool_choice, NamedToolChoice):
        raise bad_request("output_config.format: cannot be combined with tool_choice any or "
                          "tool (both constrain the reply)", "output_config.format")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name="output", schema=config.format.schema))


def chat_request(req: MessagesRequest,
                 locations: dict[str, str] | None = None) -> ChatCompletionRequest:
    """The chat request the engine runs for `req` (no `max_tokens`: the route caps it);
    `locations` is filled as `chat_messages` fills it.

    Raises:
        APIError: 400 naming the field (see the module's docstring).
    """
    messages = chat_messages(req, locations)
    tools = chat_tools(req.tools) if req.tools else []
    tool_choice, parallel = _tool_choice(req, [tool.function.name for tool in tools])
    prefill = bool(req.messages) and req.messages[-1].role == "assistant"
    return ChatCompletionRequest(
        messages=messages, model=req.model, stream=req.stream, stop=req.stop_sequences,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        tools=tools or None, tool_choice=tool_choice, parallel_tool_calls=parallel,
        chat_template_kwargs=_template_kwargs(req),
        response_format=_response_format(req, tool_choice),
        add_generation_prompt=not prefill, continue_final_message=prefill)


def is_thinking_requested(req: MessagesRequest) -> bool:
    """The request asks for thinking blocks (`enabled` or `adaptive`)."""
    return req.thinking is not None and not isinstance(req.thinking, ThinkingDisabled)


def shows_thinking(req: MessagesRequest) -> bool:
    """Thinking blocks carry their text (`display: omitted` leaves it out)."""
    return getattr(req.thinking, "display", None) != "omitted"

