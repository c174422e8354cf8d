"""Chat messages to a prompt string through the chat template.

The template is the tokenizer's, or `--chat-template` (ServeSettings.chat_template) when
given. Message content is a string or a list of text parts (joined with newlines, as vLLM
does); other part types are refused. Assistant messages keep their `tool_calls` (arguments
parsed from JSON text into objects, as vLLM hands them to templates) and earlier reasoning
(as `reasoning` and `reasoning_content`, the names templates read), `tool` messages their
`tool_call_id`; the request's tools reach the template as `tools`. Used by
`/v1/chat/completions` and `/tokenize`.
"""

from __future__ import annotations

import json
from typing import Any

import jinja2

from ringserve.http.context import AppContext
from ringserve.http.errors import bad_request
from ringserve.http.protocol import ChatMessage

# apply_chat_template's own arguments that `chat_template_kwargs` may not set: a client's
# template would be compiled and run here (vLLM refuses it too), and the others would clash
# with what render_chat passes.
_RESERVED_KWARGS = frozenset({"chat_template", "conversation", "tokenize"})
# (`tools` may be set there, as vLLM allows; the request's own `tools` win.)


def _content(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages[{index}].content: part type {part.type!r} is not "
                              "supported; allowed: text parts", "messages")
        texts.append(part.text)
    return "\n".join(texts)


def _tool_calls(message: ChatMessage, index: int) -> list[dict[str, Any]]:
    calls = []
    for j, call in enumerate(message.tool_calls or []):
        where = f"messages[{index}].tool_calls[{j}]"
        try:
            arguments: Any = json.loads(call.function.arguments)
        except ValueError:
            raise bad_request(f"{where}.function.arguments: not JSON; allowed: the arguments "
                              "as JSON text", "messages") from None
        item: dict[str, Any] = {"type": call.type,
                                "function": {"name": call.function.name, "arguments": arguments}}
        if call.id is not None:
            item["id"] = call.id
        calls.append(item)
    return calls


def conversation_of(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the template's plain dicts.

    Raises:
        APIError: no messages, a content part that is not text, or tool-call arguments
            that are not JSON.
    """
    if not messages:
        raise bad_request("messages: got an empty list, allowed: at least one message",
                          "messages")
    conversation = []
    for i, message in enumerate(messages):
        item: dict[str, Any] = {"role": message.role, "content": _content(message, i)}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = _tool_calls(message, i)
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        reasoning = message.reasoning if message.reasoning is not None \
            else message.reasoning_content
        if reasoning is not None:
            item["reasoning"] = item["reasoning_content"] = reasoning
        conversation.append(item)
    return conversation


def render_chat(ctx: AppContext, conversation: list[dict[str, Any]], *,
                add_generation_prompt: bool, continue_final_message: bool,
                template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text of a conversation (with the request's `tools`, if any).

    Raises:
        APIError: 400 for contradictory flags, a reserved key in `template_kwargs`, or a
            conversation or variables the template rejects.
    """
    reserved = sorted(_RESERVED_KWARGS & (template_kwargs or {}).keys())
    if reserved:
        raise bad_request(f"chat_template_kwargs: {', '.join(reserved)} cannot be set by a "
                          "request; allowed: the chat template's own variables",
                          "chat_template_kwargs")
    if add_generation_prompt and continue_final_message:
        raise bad_request("continue_final_message: cannot be combined with "
                          "add_generation_prompt=true (set it to false)",
                          "continue_final_message")
    options: dict[str, Any] = {
        **(template_kwargs or {}),
        "tokenize": False,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
    }
    if ctx.settings.chat_template is not None:
        options["chat_template"] = ctx.settings.chat_template
    if tools is not None:
        options["tools"] = tools
    try:
        return str(ctx.tokenizer.apply_chat_template(conversation, **options))
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        # TypeError: a variable of the wrong type (`tools`, `documents`, or one the template
        # computes with), or a `messages` variable clashing with the conversation.
        raise bad_request(f"messages: the chat template rejected them: {exc}",
                          "messages") from None
