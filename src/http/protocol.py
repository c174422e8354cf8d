"""Request bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's extras).

msgspec Structs decoded with `msgspec.json`, so a wrong type is reported with its path
(`Expected int, got str - at $.max_tokens`) and becomes a 400. Ranges are not repeated here:
`SamplingParams` checks them with messages that name the field and the allowed values.
Numeric fields are nullable (clients send `null` for "default") and get their defaults when
the SamplingParams are built (`ringserve.http.sampling`). Unknown fields are ignored, as
OpenAI's clients send fields this server does not use (`user`, `tools` ...).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from ringserve.sampling_params import INT64_MAX, INT64_MIN

# The engine core receives it as a msgpack int64: past that it cannot even be sent.
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]


class StreamOptions(msgspec.Struct, kw_only=True):
    """`stream_options`: a usage chunk at the end, or usage in every chunk."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


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


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content; only `text` parts are supported."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    """One chat message."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


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
    response_format: dict[str, Any] | None = None


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
