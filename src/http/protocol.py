"""Request bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's extras).

msgspec Structs decoded with `msgspec.json`, so a wrong type is reported with its path
(`Expected int, got str - at $.max_tokens`) and becomes a 400. Ranges are not repeated here:
`SamplingParams` checks them with messages that name the field and the allowed values.
Numeric fields are nullable (clients send `null` for "default") and get their defaults when
the SamplingParams are built (`ringserve.http.sampling`). Unknown fields are ignored, as
OpenAI's clients send fields this server does not use (`user`, `metadata` ...).
Constrained output comes as OpenAI's `response_format` or vLLM's `structured_outputs` (both
routes), tools as OpenAI's `tools` / `tool_choice` (chat); their meaning is checked where they
are turned into SamplingParams (`ringserve.http.sampling`, `ringserve.http.tool_parsers`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ringserve.sampling_params import INT64_MAX, INT64_MIN

# The engine core receives it as a msgpack int64: past that it cannot even be sent.
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]


class StreamOptions(msgspec.Struct, kw_only=True):
    """`stream_options`: a usage chunk at the end, or usage in every chunk."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """`response_format.json_schema`: OpenAI's named schema (`strict` is accepted; the
    grammar mask always enforces the schema)."""

    name: str
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """`response_format`: `{"type": "text" | "json_object" | "json_schema" |
    "structural_tag", ...}`; a structural tag is vLLM's shape (`structures` and `triggers`,
    or xgrammar's `format`)."""

    type: str
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None


class StructuredOutputsRequest(msgspec.Struct, kw_only=True):
    """vLLM's extra body field `structured_outputs` (`SamplingParams.structured_outputs`'s
    fields; a structural tag as JSON text or an object)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False


class SamplingRequest(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: Int64 = 0
    request_id: str | None = None
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @property
    def include_usage(self) -> bool:
        """A usage chunk after the finish chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage (so far) in every chunk."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingRequest, kw_only=True):
    """`POST /v1/completions`.

    `prompt` is a string, a list of strings, a list of token ids or a list of token-id
    lists (checked by `prompts_of`, since msgspec unions allow one array type only).
    """

    prompt: str | list[Any]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class ImageURL(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An `image_url` part's image: `url` is a data:, file:// or http(s) URL. `detail` is
    accepted (OpenAI's values) and has no effect, as in vLLM: the image processor decides the
    resolution."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content: a `text` part, or an `image_url` part (a
    vision-language model; `ringserve.http.chat_images`)."""

    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    """The function of an assistant message's tool call (`arguments`: JSON text)."""

    name: str
    arguments: str


class ToolCallIn(msgspec.Struct, kw_only=True):
    """A tool call of an earlier assistant message."""

    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    """One chat message: an assistant's may carry `tool_calls` (and its earlier
    `reasoning`), a `tool` message answers the call `tool_call_id`."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    """A tool's function: `parameters` is a JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, kw_only=True):
    """One entry of `tools` (only `function` tools exist)."""

    type: str = "function"
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    """The function a named `tool_choice` picks."""

    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: str = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """`POST /tokenize`: a prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[int]


def prompts_of(prompt: str | list[Any]) -> list[str | list[int]]:
    """The prompts of a completion request, each a string or a list of token ids.

    Raises:
        ValueError: `prompt` is empty or mixes kinds.
    """
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("prompt: got an empty list, allowed: a string, a list of strings, "
                         "a list of token ids or a list of token-id lists")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                             for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise ValueError("prompt: allowed: a string, a list of strings, a list of token ids or a "
                     "list of non-empty token-id lists")
