"""A Responses request, checked and translated into the chat route's terms.

`parse_request` decodes the body (an unknown field is a 400 naming it); `new_items` turns
its `input` into canonical items (`ringserve.http.agents.responses_protocol.Item`: ids given
where the client left them out, a string input one user message), refusing an unknown item
type or role, a file or audio part (not supported yet), arguments that are not JSON and a
`function_call_output` whose `call_id` answers no call of the conversation; `chat_request`
builds the `ChatCompletionRequest` the chat route would get for the whole conversation:
`instructions` as the first system message, `developer` messages as system ones (the chat
templates know no developer role), function calls joined to the assistant message before
them as its `tool_calls`, their outputs as `tool` messages, `input_image` parts as image
parts (`ringserve.http.chat_images`; errors name `input[i].content[j]`, or the chat location
for an image of a stored earlier turn), a reasoning item as the next assistant message's
`reasoning`, function tools as chat tools, `text.format` as
`response_format`, `max_output_tokens` as `max_completion_tokens`. Every 400 names the field
as the Responses request spells it (`input[2].call_id`, `tools[0].type`, `text.format.schema`);
`responses_error` renames the fields of the errors the shared chat code raises.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request

from ringserve.http.agents.responses_protocol import (
    FunctionCallIn,
    FunctionCallItem,
    FunctionCallOutputIn,
    FunctionCallOutputItem,
    FunctionToolIn,
    InputImage,
    InputPart,
    InputText,
    Item,
    MessageIn,
    MessageItem,
    OutputText,
    ReasoningIn,
    ReasoningItem,
    ReasoningText,
    ResponsesRequest,
    SummaryText,
    TextConfig,
    new_id,
)
from ringserve.http.context import AppContext
from ringserve.http.errors import APIError, bad_request, error_from_exception
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

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
UNSUPPORTED_PARTS = ("input_file", "input_audio")
MESSAGE_PARTS = ("input_text", "output_text", "input_image")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TOOL_CHOICES = ("auto", "none", "required")
FORMATS = ("text", "json_object", "json_schema")
INCLUDABLE = ("reasoning.encrypted_content",)  # accepted; reasoning items carry their text

_MISSING_FIELD = re.compile(r"missing required field `([^`]*)`")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")
_ITEM_KINDS: dict[str, type[Any]] = {"message": MessageIn, "function_call": FunctionCallIn,
                                     "function_call_output": FunctionCallOutputIn,
                                     "reasoning": ReasoningIn}


async def parse_request(ctx: AppContext, request: Request) -> ResponsesRequest:
    """The decoded body.

    Raises:
        APIError: 400 for malformed JSON, a field of the wrong type (its path named) or a
            field this server does not support (named, since it could change the output).
    """
    try:
        return await ctx.parse(request, ResponsesRequest)
    except APIError as error:
        match = _UNKNOWN_FIELD.search(error.message)
        if match is None:
            raise
        name = ".".join(p for p in (match.group(2), match.group(1)) if p)
        raise bad_request(f"{name}: this field is not supported by /v1/responses (it could "
                          "change the output); leave it out", name) from None


def _convert(raw: Any, kind: type[T], where: str) -> T:
    """`raw` as `kind`; a mismatch is a 400 whose path starts at `where`."""
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _UNKNOWN_FIELD.search(text)
        if match is not None:
            name = ".".join(p for p in (where, match.group(2), match.group(1)) if p)
            raise bad_request(f"{name}: this field is not supported; leave it out",
                              name) from None
        path = where
        missing = _MISSING_FIELD.search(text)
        if missing is not None and " - at `$" not in text:
            path = f"{where}.{missing.group(1)}"
            raise bad_request(f"{path}: required", path) from None
        if " - at `$" in text:
            text, _, rest = text.partition(" - at `$")
            path = where + rest.rstrip("`")
        raise bad_request(f"{path}: {text}", path) from None


def _texts(parts: list[InputPart], where: str, allowed: tuple[str, ...], *,
           first: int = 0) -> list[str]:
    texts = []
    for j, part in enumerate(parts, first):
        at = f"{where}[{j}]"
        if part.type in UNSUPPORTED_PARTS:
            raise bad_request(f"{at}.type: {part.type} parts are not supported yet; allowed: "
                              f"{', '.join(allowed)}", f"{at}.type")
        if part.type not in allowed:
            raise bad_request(f"{at}.type: got {part.type!r}, allowed: {', '.join(allowed)}",
                              f"{at}.type")
        if part.text is None:
            raise bad_request(f"{at}.text: required in a {part.type} part", f"{at}.text")
        texts.append(part.text)
    return texts


def _text(content: str | list[InputPart], where: str) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(_texts(content, where, TEXT_PARTS))


def _message(item: MessageIn, where: str) -> MessageItem:
    if item.role not in ROLES:
        raise bad_request(f"{where}.role: got {item.role!r}, allowed: {', '.join(ROLES)}",
                          f"{where}.role")
    parts = [InputPart(type="input_text", text=item.content)] if isinstance(
        item.content, str) else item.content
    allowed = TEXT_PARTS if item.role == "assistant" else MESSAGE_PARTS
    content: list[InputText | OutputText | InputImage] = []
    for j, part in enumerate(parts):
        at = f"{where}.content[{j}]"
        if part.type == "input_image" and item.role != "assistant":
            if part.image_url is None or part.text is not None:
                raise bad_request(f"{at}.image_url: required (a URL string) in an input_image "
                                  "part, without text", f"{at}.image_url")
            content.append(InputImage(part.image_url, part.detail or "auto"))
            continue
        if part.image_url is not None:
            raise bad_request(f"{at}.image_url: only in an input_image part of a user, system "
                              "or developer message", f"{at}.image_url")
        text = _texts([part], f"{where}.content", allowed, first=j)[0]
        content.append(OutputText(text) if item.role == "assistant" else InputText(text))
    return MessageItem(id=item.id or new_id("msg"), role=item.role, content=content)


def _function_call(item: FunctionCallIn, where: str) -> FunctionCallItem:
    try:
        json.loads(item.arguments)
    except ValueError:
        raise bad_request(f"{where}.arguments: not JSON; allowed: the arguments as JSON text",
                          f"{where}.arguments") from None
    return FunctionCallItem(id=item.id or new_id("fc"), call_id=item.call_id, name=item.name,
                            arguments=item.arguments)


def _reasoning(item: ReasoningIn, where: str) -> ReasoningItem:
    summary = _texts(item.summary, f"{where}.summary", ("summary_text",))
    content = _texts(item.content or [], f"{where}.content", ("reasoning_text",))
    return ReasoningItem(id=item.id or new_id("rs"), summary=[SummaryText(t) for t in summary],
                         content=[ReasoningText(t) for t in content],
                         encrypted_content=item.encrypted_content)


def _item(raw: dict[str, Any], where: str, calls: set[str]) -> Item:
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind not in ITEM_TYPES:
        raise bad_request(f"{where}.type: got {kind!r}, allowed: {', '.join(ITEM_TYPES)} (or a "
                          "message without a type)", f"{where}.type")
    parsed = _convert(raw, _ITEM_KINDS[kind], where)
    if isinstance(parsed, MessageIn):
        return _message(parsed, where)
    if isinstance(parsed, FunctionCallIn):
        call = _function_call(parsed, where)
        calls.add(call.call_id)
        return call
    if isinstance(parsed, FunctionCallOutputIn):
        if parsed.call_id not in calls:
            raise bad_request(f"{where}.call_id: {parsed.call_id!r} answers no function_call "
                              "of the conversation; allowed: the call_id of an earlier "
                              "function_call", f"{where}.call_id")
        return FunctionCallOutputItem(id=parsed.id or new_id("fco"), call_id=parsed.call_id,
                                      output=_text(parsed.output, f"{where}.output"))
    assert isinstance(parsed, ReasoningIn)
    return _reasoning(parsed, where)


def new_items(req: ResponsesRequest, previous: list[Item]) -> list[Item]:
    """The request's `input` as canonical items (`previous`: the stored conversation it
    continues, whose function calls its outputs may answer).

    Raises:
        APIError: 400 naming the field (see the module's docstring).
    """
    raw = req.input
    if raw is None:
        if req.previous_response_id is None:
            raise bad_request("input: required (a string or a list of items) unless "
                              "previous_response_id is given", "input")
        return []
    if isinstance(raw, str):
        return [MessageItem(id=new_id("msg"), role="user", content=[InputText(raw)])]
    if not raw and req.previous_response_id is None:
        raise bad_request("input: got an empty list, allowed: at least one item", "input")
    calls = {item.call_id for item in previous if isinstance(item, FunctionCallItem)}
    return [_item(entry, f"input[{i}]", calls) for i, entry in enumerate(raw)]


def check_fields(req: ResponsesRequest) -> None:
    """The accepted fields that change nothing must hold values that change nothing.

    Raises:
        APIError: 400 naming `include` or `truncation`.
    """
    for i, name in enumerate(req.include or []):
        if name not in INCLUDABLE:
            raise bad_request(f"include[{i}]: {name!r} is not supported; allowed: "
                              f"{', '.join(INCLUDABLE)} (or leave include empty)", "include")
    if req.truncation not in (None, "disabled"):
        raise bad_request(f"truncation: got {req.truncation!r}, allowed: disabled (the "
                          "input is never truncated)", "truncation")


def tools_of(req: ResponsesRequest) -> list[FunctionToolIn]:
    """The request's function tools.

    Raises:
        APIError: 400 naming `tools[i].type` (not a function tool) or `tools[i].name`
            (empty, or given twice).
    """
    tools: list[FunctionToolIn] = []
    for i, raw in enumerate(req.tools or []):
        kind = raw.get("type")
        if kind != "function":
            raise bad_request(f"tools[{i}].type: got {kind!r}, allowed: function (only "
                              "function tools are supported)", f"tools[{i}].type")
        tool = _convert(raw, FunctionToolIn, f"tools[{i}]")
        if not tool.name:
            raise bad_request(f"tools[{i}].name: got an empty name, allowed: a function name",
                              f"tools[{i}].name")
        if any(t.name == tool.name for t in tools):
            raise bad_request(f"tools[{i}].name: {tool.name!r} is given twice; allowed: "
                              "distinct names", f"tools[{i}].name")
        tools.append(tool)
    return tools


def tool_choice_of(req: ResponsesRequest) -> str | NamedToolChoice | None:
    """`tool_choice` in the chat request's terms.

    Raises:
        APIError: 400 naming `tool_choice` (an unknown mode, a choice that constrains the
            output together with `text.format`) or its `type` / `name`.
    """
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        if choice is not None and choice not in TOOL_CHOICES:
            raise bad_request(f"tool_choice: got {choice!r}, allowed: auto, none, required or "
                              '{"type": "function", "name": ...}', "tool_choice")
        chat_choice: str | NamedToolChoice | None = choice
    else:
        if choice.get("type") != "function":
            raise bad_request(f"tool_choice.type: got {choice.get('type')!r}, allowed: "
                              "function", "tool_choice.type")
        extra = sorted(set(choice) - {"type", "name"})
        if extra:
            raise bad_request(f"tool_choice.{extra[0]}: not supported; a function choice is "
                              '{"type": "function", "name": ...}', f"tool_choice.{extra[0]}")
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("tool_choice.name: required (the function's name)",
                              "tool_choice.name")
        chat_choice = NamedToolChoice(function=NamedFunction(name=name))
    fmt = req.text.format if req.text is not None else None
    forced = chat_choice == "required" or isinstance(chat_choice, NamedToolChoice)
    if forced and req.tools and fmt is not None and fmt.type != "text":
        raise bad_request("tool_choice: a required or named tool choice constrains the output, "
                          "so it cannot be combined with a text.format other than text",
                          "tool_choice")
    return chat_choice


def response_format_of(text: TextConfig | None) -> ResponseFormat | None:
    """`text.format` as the chat request's `response_format` (None: plain text).

    Raises:
        APIError: 400 naming `text.format.type`, `.name` or `.schema`.
    """
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.type != "json_schema":
        raise bad_request(f"text.format.type: got {fmt.type!r}, allowed: {', '.join(FORMATS)}",
                          "text.format.type")
    if not fmt.name:
        raise bad_request("text.format.name: required with type json_schema",
                          "text.format.name")
    if fmt.schema is None:
        raise bad_request("text.format.schema: required with type json_schema (a JSON schema "
                          "object)", "text.format.schema")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name, schema=fmt.schema, strict=fmt.strict, description=fmt.description))


def _chat_content(item: MessageItem, chat_index: int, input_index: int | None,
                  locations: dict[str, str]) -> str | list[ContentPart]:
    """A message item's chat content: its texts joined, or with images a list of parts
    (each image's chat location, `messages[chat_index].content[j]`, mapped to
    `input[input_index].content[j]` when the item came in with this request)."""
    if not any(isinstance(p, InputImage) for p in item.content):
        return "\n".join(p.text for p in item.content if not isinstance(p, InputImage))
    parts: list[ContentPart] = []
    for j, part in enumerate(item.content):
        if isinstance(part, InputImage):
            if input_index is not None:
                locations[f"messages[{chat_index}].content[{j}]"] = \
                    f"input[{input_index}].content[{j}]"
            parts.append(ContentPart(type="image_url", image_url=ImageURL(url=part.image_url)))
        else:
            parts.append(ContentPart(type="text", text=part.text))
    return parts


def chat_messages(instructions: str | None, conversation: list[Item], *, new_from: int = 0,
                  locations: dict[str, str] | None = None) -> list[ChatMessage]:
    """The conversation as chat messages (see the module's docstring).

    Args:
        new_from: the conversation index of this request's first `input` item.
        locations: filled with each new image part's chat location and its `input` one.
    """
    messages: list[ChatMessage] = []
    if instructions is not None:
        messages.append(ChatMessage(role="system", content=instructions))
    names = locations if locations is not None else {}
    reasoning: str | None = None
    assistant: ChatMessage | None = None  # the message later function calls join
    for k, item in enumerate(conversation):
        if isinstance(item, ReasoningItem):
            text = "\n".join(p.text for p in item.content) or "\n".join(
                p.text for p in item.summary)
            if text:
                reasoning = text if reasoning is None else reasoning + "\n" + text
            assistant = None
        elif isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            content = _chat_content(item, len(messages), k - new_from if k >= new_from else None,
                                    names)
            message = ChatMessage(role=role, content=content)
            assistant = message if role == "assistant" else None
            if assistant is not None:
                message.reasoning, reasoning = reasoning, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            if assistant is None:
                assistant = ChatMessage(role="assistant", content=None, reasoning=reasoning)
                reasoning = None
                messages.append(assistant)
            call = ToolCallIn(id=item.call_id, function=FunctionCall(name=item.name,
                                                                     arguments=item.arguments))
            assistant.tool_calls = [*(assistant.tool_calls or []), call]
        else:
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=item.output))
            assistant = None
    return messages


def chat_request(req: ResponsesRequest, conversation: list[Item],
                 tools: list[FunctionToolIn], *, stream: bool, new_from: int = 0,
                 locations: dict[str, str] | None = None) -> ChatCompletionRequest:
    """The chat request the chat route would run for this turn (`new_from`, `locations`:
    as `chat_messages` takes them).

    Raises:
        APIError: 400 naming `tool_choice` or `text.format` (see `tool_choice_of`,
            `response_format_of`).
    """
    definitions = [ToolDefinition(function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in tools]
    return ChatCompletionRequest(
        model=req.model, messages=chat_messages(req.instructions, conversation,
                                                 new_from=new_from, locations=locations),
        tools=definitions or None, tool_choice=tool_choice_of(req),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        response_format=response_format_of(req.text), temperature=req.temperature,
        top_p=req.top_p, max_completion_tokens=req.max_output_tokens, stream=stream,
        user=req.user)


_RENAMED = (("max_tokens", "max_output_tokens"), ("messages", "input"), ("prompt", "input"),
            ("response_format", "text.format"))
_TOOL_FIELD = re.compile(r"^tools\[(\d+)\]\.function\.")


def responses_error(exc: Exception, req: ResponsesRequest) -> APIError | None:
    """The error the shared chat code raised, with its field named as this request spells
    it (`max_tokens` -> `max_output_tokens`, `messages` -> `input` ...); None for a bug."""
    error = error_from_exception(exc)
    if error is None or error.status != 400:
        return error
    param, message = error.param, error.message
    if message.startswith("structured_outputs"):
        fmt = req.text.format if req.text is not None else None
        param = "text.format.schema" if fmt is not None and fmt.type != "text" else "tools"
    elif param is not None:
        for old, new in _RENAMED:
            if param == old or param.startswith(old + "."):
                if message.startswith(param + ":"):
                    message = new + param[len(old):] + message[len(param):]
                param = new + param[len(old):]
                break
        param = _TOOL_FIELD.sub(r"tools[\1].", param)
    return APIError(error.status, message, param)
