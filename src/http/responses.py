"""Response bodies of the OpenAI-compatible API, encoded with msgspec.

Field names and nesting follow OpenAI's (and vLLM's extras: `stop_reason`,
`prompt_logprobs`), so the official clients parse them. Each choice also tells which weights
its tokens came from (clients that do not know the fields ignore them): a full response's
choice carries `weight_versions`, the spans of its tokens by weight version
(`[{"version": "v1", "start": 0}, {"version": "v2", "start": 17}]`, empty when no token was
generated), a stream chunk's choice `weight_version`, the version of that delta's tokens (of
its last one, should a delta span an update; null for the start-up weights and before the
first token). `json_response` encodes one for a plain (non-streaming) answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from starlette.responses import Response

from ringserve.outputs import WeightVersionSpan


class UsageInfo(msgspec.Struct, kw_only=True):
    """Token counts of a request (all prompts and all `n` choices)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    """`usage.prompt_tokens_details` (vLLM's `--enable-prompt-tokens-details`)."""

    cached_tokens: int = 0


class UsageWithDetails(UsageInfo, kw_only=True):
    """UsageInfo with the prompt's prefix-cache hit (only with the flag, so the usage of a
    server without it keeps exactly its three fields)."""

    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> UsageInfo:
    """A UsageInfo with its total; with `cached_tokens` (the prompt tokens read from the
    prefix cache) also `prompt_tokens_details`."""
    total = prompt_tokens + completion_tokens
    if cached_tokens is None:
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=total)
    return UsageWithDetails(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                            total_tokens=total,
                            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class WeightVersionOut(msgspec.Struct, kw_only=True):
    """The weight version of a choice's tokens from index `start` on (None: the start-up
    weights)."""

    version: str | None
    start: int


def weight_versions(spans: Sequence[WeightVersionSpan]) -> list[WeightVersionOut]:
    """A choice's `weight_versions` from its output's spans."""
    return [WeightVersionOut(version=span.version, start=span.start) for span in spans]


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's prompt-logprob entry (keyed by token id in the position's dict)."""

    logprob: float
    rank: int | None
    decoded_token: str | None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """OpenAI's legacy completions logprobs (parallel lists, one entry per token)."""

    text_offset: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct, kw_only=True):
    """One choice of a completion (or a stream chunk's delta of it): a full response sets
    `weight_versions`, a chunk `weight_version`; the one left UNSET is not encoded."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    weight_versions: list[WeightVersionOut] | msgspec.UnsetType = msgspec.UNSET
    weight_version: str | msgspec.UnsetType | None = msgspec.UNSET


class CompletionResponse(msgspec.Struct, kw_only=True):
    """A completion, or one chunk of a completion stream (`object` tells which)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    """One candidate of a chat logprob entry."""

    token: str
    logprob: float
    bytes: list[int] | None


class LogprobEntry(msgspec.Struct, kw_only=True):
    """The sampled token of one position and its top candidates."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    """Chat logprobs: one entry per generated token."""

    content: list[LogprobEntry] | None = None


class FunctionCallOut(msgspec.Struct, kw_only=True):
    """The function of a tool call: `arguments` is JSON text."""

    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, kw_only=True):
    """A tool call of the assistant's message."""

    id: str
    type: str = "function"
    function: FunctionCallOut


class ChatMessageOut(msgspec.Struct, kw_only=True):
    """The assistant's message of a chat choice: `reasoning` (vLLM's current name; it was
    `reasoning_content`) with a reasoning parser, `tool_calls` when the model called tools."""

    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] = msgspec.field(default_factory=list)


class ChatChoice(msgspec.Struct, kw_only=True):
    """One choice of a chat completion."""

    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_versions: list[WeightVersionOut] = msgspec.field(default_factory=list)


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    """A chat completion."""

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunction(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A tool call's function in a stream: the name first, then argument fragments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of a tool call in a stream (OpenAI's shape): the first piece of call `index`
    carries its `id`, `type` and name, later ones argument fragments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a chat stream chunk adds to a choice's message (role only in the first)."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(msgspec.Struct, kw_only=True):
    """One choice's delta in a chat stream chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_version: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One chunk of a chat completion stream."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    """One entry of `/v1/models`."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "ringserve"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(msgspec.Struct, kw_only=True):
    """`/v1/models`."""

    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct, kw_only=True):
    """`/tokenize`."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    """`/detokenize`."""

    prompt: str


def json_response(body: Any, status: int = 200) -> Response:
    """A JSON response of a msgspec-encodable body."""
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")
