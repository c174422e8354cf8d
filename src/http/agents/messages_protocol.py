"""Anthropic's Messages request and response bodies (`/v1/messages`, `/count_tokens`).

msgspec Structs decoded with `msgspec.json`: a wrong type or a missing field names its path
(`Expected int >= 1 - at $.max_tokens`) and becomes the route's 400. Unlike the OpenAI
routes', these bodies refuse unknown fields (`forbid_unknown_fields`): a field this server
does not know could change the answer, so it is a 400 naming it rather than silently
ignored. The fields of Anthropic's request that change nothing here are declared and
accepted: `metadata`, `service_tier`, `container`, `cache_control` (the prefix cache works
implicitly), `context_management`, `diagnostics`, `inference_geo`, `speed`,
`user_profile_id`, `workspace_id`, and a block's `cache_control` and `citations`.

Content blocks are tagged unions on `type`; `explain_block_type` turns msgspec's message for
an unknown block type into one that lists the allowed types. Image blocks carry a base64 or
URL `source` (the translation turns them into the chat route's image parts). Tools stay
plain objects here: a server tool (`web_search_...`) has fields of its own, so its `type` is
checked first, then the tool is converted to `Tool` (`messages_translate`).

The response side (`MessageOut`, the content blocks, `Usage`) is what both the plain
response and the stream's events (`messages_stream`) carry.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from ringserve.http.errors import APIError, bad_request

# Anthropic's own floor for a thinking budget.
MIN_THINKING_BUDGET = 1024


class _Block(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    """A content block of a request (tagged by `type`)."""


class TextBlock(_Block, tag="text"):
    """`{"type": "text", "text"}` (`cache_control` and `citations` accepted, no effect)."""

    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ImageSource(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An image block's `source`: `{"type": "base64", "media_type", "data"}` or
    `{"type": "url", "url"}` (checked by the translation, which names the missing field)."""

    type: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(_Block, tag="image"):
    """An image (a vision-language model; `messages_translate` makes it an image part)."""

    source: ImageSource
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(_Block, tag="tool_use"):
    """An earlier call of a tool by the assistant."""

    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlock(_Block, tag="tool_result"):
    """The result of the call `tool_use_id`: a string or text blocks."""

    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None
    toolset_name: str | None = None


class ThinkingBlock(_Block, tag="thinking"):
    """Earlier reasoning of the assistant (its `signature` is not checked)."""

    thinking: str
    signature: str = ""
    cache_control: dict[str, Any] | None = None


class RedactedThinkingBlock(_Block, tag="redacted_thinking"):
    """Opaque earlier reasoning: accepted and left out of the prompt (there is no text)."""

    data: str


InputBlock = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | \
    RedactedThinkingBlock

BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class InputMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One message of `messages`."""

    role: Literal["user", "assistant"]
    content: str | list[InputBlock]


class Tool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A client tool: its arguments are `input_schema`, a JSON schema of an object.

    `strict` is accepted (a forced choice always enforces the schema; `auto` parses free
    text), `eager_input_streaming` changes nothing (arguments always stream).
    """

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None


class _Choice(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    """A `tool_choice` (tagged by `type`)."""

    disable_parallel_tool_use: bool = False


class ToolChoiceAuto(_Choice, tag="auto"):
    """The model decides (the server's `--tool-call-parser` reads the calls)."""


class ToolChoiceAny(_Choice, tag="any"):
    """At least one call of any tool."""


class ToolChoiceTool(_Choice, tag="tool"):
    """A call of the tool `name`."""

    name: str


class ToolChoiceNone(msgspec.Struct, tag_field="type", tag="none", forbid_unknown_fields=True):
    """No calls."""


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone

Display = Literal["summarized", "omitted"]


class ThinkingEnabled(msgspec.Struct, tag_field="type", tag="enabled",
                      forbid_unknown_fields=True, kw_only=True):
    """Extended thinking with a token budget (checked as Anthropic does; the reasoning is
    not cut at the budget)."""

    budget_tokens: int
    display: Display | None = None


class ThinkingAdaptive(msgspec.Struct, tag_field="type", tag="adaptive",
                       forbid_unknown_fields=True, kw_only=True):
    """The model decides how much to think."""

    display: Display | None = None


class ThinkingDisabled(msgspec.Struct, tag_field="type", tag="disabled",
                       forbid_unknown_fields=True):
    """No thinking (templates that read `enable_thinking` get False)."""


ThinkingConfig = ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled


class JsonOutputFormat(msgspec.Struct, tag_field="type", tag="json_schema",
                       forbid_unknown_fields=True):
    """`output_config.format`: the reply is JSON valid for `schema` (structured outputs)."""

    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`output_config`: `format` constrains the reply; `effort` is accepted, no effect."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class MessagesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`POST /v1/messages` (and `/v1/messages/count_tokens`, which needs no `max_tokens`:
    the route requires it on `/v1/messages`)."""

    model: str
    messages: list[InputMessage]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    stream: bool = False
    # Accepted, no effect here.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None
    cache_control: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    diagnostics: Any = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


_BLOCK_TYPE = re.compile(r"Invalid value '([^']*)' - at `\$\.(\S*\.content\[\d+\])\.type`")


def explain_block_type(error: APIError) -> APIError:
    """msgspec's 400 for an unknown content block type, reworded to name the block and the
    allowed types (any other error unchanged)."""
    match = _BLOCK_TYPE.search(error.message)
    if error.status != 400 or match is None:
        return error
    kind, where = match.groups()
    nested = where.count(".content[") > 1  # a tool_result's content holds text only
    allowed = "text" if nested else ", ".join(BLOCK_TYPES)
    return bad_request(f"{where}.type: block type {kind!r} is not supported; allowed: "
                       f"{allowed}", f"{where}.type")


# -- the response ----------------------------------------------------------------------------


class _OutBlock(msgspec.Struct, tag_field="type", kw_only=True):
    """A content block of a response."""


class TextOut(_OutBlock, tag="text"):
    """Answer text."""

    text: str


class ThinkingOut(_OutBlock, tag="thinking"):
    """The reasoning the server's `--reasoning-parser` split off (`signature` is always
    "": this server signs nothing and checks no signature it is sent back)."""

    thinking: str
    signature: str = ""


class ToolUseOut(_OutBlock, tag="tool_use"):
    """A tool call; `input` is its parsed arguments."""

    id: str
    name: str
    input: dict[str, Any]


OutBlock = TextOut | ThinkingOut | ToolUseOut


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    """`usage.output_tokens_details`: how many output tokens were reasoning."""

    thinking_tokens: int


class Usage(msgspec.Struct, kw_only=True):
    """Anthropic's usage: `input_tokens` counts the prompt tokens not read from the prefix
    cache, `cache_read_input_tokens` those read; the cache writes implicitly, so
    `cache_creation_input_tokens` is 0. `output_tokens_details` only when there was
    reasoning."""

    input_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails | None = None


class MessageOut(msgspec.Struct, kw_only=True):
    """The assistant's message."""

    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[OutBlock]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensOut(msgspec.Struct):
    """`POST /v1/messages/count_tokens`'s answer."""

    input_tokens: int
