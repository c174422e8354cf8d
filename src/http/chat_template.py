"""Chat messages to a prompt string through the chat template.

The template is the tokenizer's, or `--chat-template` (ServeSettings.chat_template) when
given. Message content is a string or a list of parts: text parts alone are joined with
newlines (as vLLM does); with `image_url` parts (`chat_conversation`, for the chat routes) the
content stays a list of `{"type": "text", "text": ...}` and `{"type": "image"}` parts, the form
templates write the model's image placeholder for, and the images are collected in order for
`ringserve.http.chat_images`. Other part types are refused. Assistant messages keep their
`tool_calls` (arguments parsed from JSON text into objects, as vLLM hands them to templates)
and earlier reasoning (as `reasoning` and `reasoning_content`, the names templates read),
`tool` messages their `tool_call_id`; the request's tools reach the template as `tools`. Used by
`/v1/chat/completions`, the agents' routes and `/tokenize` (text only).
"""

from __future__ import annotations

import json
from typing import Any

import jinja2

from ringserve.engine.frontend.multimodal.chat_parts import ImageRef, image_part
from ringserve.http.context import AppContext
from ringserve.http.errors import bad_request
from ringserve.http.protocol import ChatMessage, ContentPart

# apply_chat_template's own arguments that `chat_template_kwargs` may not set: a client's
# template would be compiled and run here (vLLM refuses it too), and the others would clash
# with what render_chat passes.
_RESERVED_KWARGS = frozenset({"chat_template", "conversation", "tokenize"})
# (`tools` may be set there, as vLLM allows; the request's own `tools` win.)


def _content(message: ChatMessage, index: int,
             images: list[ImageRef] | None) -> str | list[dict[str, Any]]:
    """A message's content for the template: a string, or (with image parts, when `images`
    collects them) a list of `{"type": "text"}` and `{"type": "image"}` parts."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, part in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        if part.type == "text" and part.text is not None and part.image_url is None:
            parts.append({"type": "text", "text": part.text})
            texts.append(part.text)
        elif part.type == "image_url" and part.image_url is not None and part.text is None:
            if images is None:
                raise bad_request(f"{where}: image parts are not supported on this route; "
                                  "allowed: text parts", "messages")
            images.append(ImageRef(where, part.image_url.url))
            parts.append(image_part())
        else:
            raise bad_request(f"{where}: {_misfit(part)}; allowed: {{'type': 'text', "
                              "'text': ...}} and {'type': 'image_url', 'image_url': "
                              "{'url': ...}}", "messages")
    if len(texts) == len(parts):
        return "\n".join(texts)  # text only: joined with newlines, as vLLM does
    return parts


def _misfit(part: ContentPart) -> str:
    """What is wrong with a part that is neither a text part nor an image part."""
    if part.type not in ("text", "image_url"):
        return f"part type {part.type!r} is not supported"
    given = [name for name in ("text", "image_url") if getattr(part, name) is not None]
    return (f"a part of type {part.type!r} needs its {part.type!r} field alone; got "
            f"{', '.join(given) or 'neither text nor image_url'}")


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
    """The messages as the template's plain dicts, for routes that take text only.

    Raises:
        APIError: no messages, a content part that is not text, or tool-call arguments
            that are not JSON.
    """
    return _conversation(messages, None)


def chat_conversation(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]],
                                                             list[ImageRef]]:
    """The messages as the template's plain dicts, and their images in order (each image
    part is `{"type": "image"}` in a list content; `ringserve.http.chat_images` renders them).

    Raises:
        APIError: no messages, a content part that is neither text nor an image, or
            tool-call arguments that are not JSON.
    """
    images: list[ImageRef] = []
    return _conversation(messages, images), images


def _conversation(messages: list[ChatMessage],
                  images: list[ImageRef] | None) -> list[dict[str, Any]]:
    if not messages:
        raise bad_request("messages: got an empty list, allowed: at least one message",
                          "messages")
    conversation = []
    for i, message in enumerate(messages):
        item: dict[str, Any] = {"role": message.role, "content": _content(message, i, images)}
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
