"""Chat messages to a prompt string through the chat template.

The template is the tokenizer's, or `--chat-template` (ServeSettings.chat_template) when
given. Message content is a string or a list of text parts (joined with newlines, as vLLM
does); other part types are refused. Used by `/v1/chat/completions` and `/tokenize`.
"""

from __future__ import annotations

from typing import Any

import jinja2

from ringserve.http.context import AppContext
from ringserve.http.errors import bad_request
from ringserve.http.protocol import ChatMessage

# apply_chat_template's own arguments that `chat_template_kwargs` may not set: a client's
# template would be compiled and run here (vLLM refuses it too), and the others would clash
# with what render_chat passes.
_RESERVED_KWARGS = frozenset({"chat_template", "conversation", "tokenize"})


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


def conversation_of(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as the template's plain dicts.

    Raises:
        APIError: no messages, or a content part that is not text.
    """
    if not messages:
        raise bad_request("messages: got an empty list, allowed: at least one message",
                          "messages")
    conversation = []
    for i, message in enumerate(messages):
        item = {"role": message.role, "content": _content(message, i)}
        if message.name is not None:
            item["name"] = message.name
        conversation.append(item)
    return conversation


def render_chat(ctx: AppContext, conversation: list[dict[str, str]], *,
                add_generation_prompt: bool, continue_final_message: bool,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of a conversation.

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
    try:
        return str(ctx.tokenizer.apply_chat_template(conversation, **options))
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        # TypeError: a variable of the wrong type (`tools`, `documents`, or one the template
        # computes with), or a `messages` variable clashing with the conversation.
        raise bad_request(f"messages: the chat template rejected them: {exc}",
                          "messages") from None
