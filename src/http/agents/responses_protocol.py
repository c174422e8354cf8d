"""The wire shapes of OpenAI's Responses API (`/v1/responses`): the request, the items of a
conversation, the response object and the stream's events.

The request is decoded in two steps. `ResponsesRequest` (unknown fields refused by name:
one this server does not know could change the output) carries `input` and `tools` as plain
JSON, because OpenAI's easy input form lets a message leave out its `type`, which a msgspec
tagged union cannot express, and because a tool or item of an unknown type deserves a message
naming its type rather than its first missing field; `ringserve.http.agents.responses_input`
then converts each entry into the `*In` Struct its `type` names. Input items ignore fields
they do not know: clients send back the output items they got, with whatever fields
(`status`, `annotations`, `logprobs`, `phase` ...) their version of the API has.

Items are stored and answered in one canonical shape (`Item`: a message with typed content
parts, a function call, a function call's output, a reasoning item), the same whether they
came in as input or went out as output, so `GET /v1/responses/{id}/input_items` and a
continuation by `previous_response_id` read them as they are.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

import msgspec


def new_id(prefix: str) -> str:
    """A fresh id in OpenAI's shape: `resp_`, `msg_`, `fc_`, `rs_` ... and random hex."""
    return f"{prefix}_{uuid.uuid4().hex}"


# -- the request -------------------------------------------------------------------------


class InputPart(msgspec.Struct, kw_only=True):
    """One content part of an input message (its type is checked on conversion:
    `input_text` / `output_text`, `input_image` with its `image_url` (a URL string; `detail`
    accepted, no effect, as in vLLM); files and audio are refused by name)."""

    type: str
    text: str | None = None
    image_url: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class MessageIn(msgspec.Struct, kw_only=True):
    """A message item (`type` may be left out): role and a string or text parts."""

    role: str
    content: str | list[InputPart]
    type: str = "message"
    id: str | None = None


class FunctionCallIn(msgspec.Struct, kw_only=True):
    """A function call the model made earlier (`arguments`: JSON text)."""

    call_id: str
    name: str
    arguments: str
    type: str = "function_call"
    id: str | None = None


class FunctionCallOutputIn(msgspec.Struct, kw_only=True):
    """What the client's function returned for the call `call_id`."""

    call_id: str
    output: str | list[InputPart]
    type: str = "function_call_output"
    id: str | None = None


class ReasoningIn(msgspec.Struct, kw_only=True):
    """A reasoning item the model produced earlier (its text goes to the next assistant
    message's `reasoning`, as the chat template reads it)."""

    type: str = "reasoning"
    id: str | None = None
    summary: list[InputPart] = msgspec.field(default_factory=list)
    content: list[InputPart] | None = None
    encrypted_content: str | None = None


class FunctionToolIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A function tool: `parameters` is the JSON schema of its arguments."""

    type: str
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormatIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`text.format`: `{"type": "text" | "json_object"}` or a flat
    `{"type": "json_schema", "name", "schema", "strict", "description"}`."""

    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`text`: the output's format (`verbosity`, a hint, is accepted and changes nothing)."""

    format: TextFormatIn | None = None
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`reasoning`: accepted and echoed; `effort` has no effect (the model reasons as its
    template and the reasoning parser say), `summary` none either (no summaries are made)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/responses`. The last group of fields changes nothing here and is accepted
    as OpenAI's clients send it (`include` only empty or asking for reasoning's encrypted
    content, which stays null; `truncation` only "disabled")."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = False
    include: list[str] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None


# -- items: stored, listed and answered --------------------------------------------------


class InputText(msgspec.Struct, tag="input_text", tag_field="type"):
    """Text a user, system or developer message carried."""

    text: str


class InputImage(msgspec.Struct, tag="input_image", tag_field="type"):
    """An image a user, system or developer message carried (its URL, as given)."""

    image_url: str
    detail: str = "auto"


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    """Text the assistant wrote."""

    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type"):
    """Reasoning the model wrote (the reasoning parser's split)."""

    text: str


class SummaryText(msgspec.Struct, tag="summary_text", tag_field="type"):
    """A reasoning summary (kept when a client sends one back; none is made here)."""

    text: str


class MessageItem(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    """A message: the assistant's carry `output_text` parts, the others `input_text` and
    `input_image`."""

    id: str
    role: str
    content: list[InputText | OutputText | InputImage]
    status: str = "completed"


class FunctionCallItem(msgspec.Struct, kw_only=True, tag="function_call", tag_field="type"):
    """A call of one of the request's function tools."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class FunctionCallOutputItem(msgspec.Struct, kw_only=True, tag="function_call_output",
                             tag_field="type"):
    """A function's result, answering `call_id`."""

    id: str
    call_id: str
    output: str
    status: str = "completed"


class ReasoningItem(msgspec.Struct, kw_only=True, tag="reasoning", tag_field="type"):
    """The model's reasoning (`content`), with `summary` always empty in output."""

    id: str
    summary: list[SummaryText] = msgspec.field(default_factory=list)
    content: list[ReasoningText] = msgspec.field(default_factory=list)
    encrypted_content: str | None = None
    status: str = "completed"


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


# -- the response object -----------------------------------------------------------------


class InputTokensDetails(msgspec.Struct, kw_only=True):
    """`cached_tokens`: prompt tokens read from the prefix cache (which writes implicitly,
    so `cache_write_tokens` is 0)."""

    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    """`reasoning_tokens`: the output tokens that were reasoning."""

    reasoning_tokens: int


class Usage(msgspec.Struct, kw_only=True):
    """A response's token counts."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct, kw_only=True):
    """Why a response is incomplete (`max_output_tokens`: the output cap or the context
    ran out)."""

    reason: str


class ResponseError(msgspec.Struct, kw_only=True):
    """Why a response failed."""

    code: str
    message: str


class FunctionToolOut(msgspec.Struct, kw_only=True):
    """A function tool as the response echoes it."""

    name: str
    parameters: dict[str, Any] | None
    strict: bool | None
    description: str | None
    type: str = "function"


class NamedToolChoiceOut(msgspec.Struct, kw_only=True):
    """`{"type": "function", "name": ...}`."""

    name: str
    type: str = "function"


class TextFormatOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`text.format` as echoed (`text` unless a format was given)."""

    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextOut(msgspec.Struct, kw_only=True):
    """`text` as echoed."""

    format: TextFormatOut = msgspec.field(default_factory=lambda: TextFormatOut(type="text"))
    verbosity: str | None = None


class ResponseObject(msgspec.Struct, kw_only=True):
    """OpenAI's response object (what POST and GET answer and the lifecycle events carry).

    `status`: queued, in_progress, completed, incomplete, failed or cancelled.
    """

    id: str
    created_at: int
    status: str
    model: str
    output: list[Item]
    parallel_tool_calls: bool
    tool_choice: str | NamedToolChoiceOut
    tools: list[FunctionToolOut]
    object: str = "response"
    background: bool = False
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    previous_response_id: str | None = None
    reasoning: ReasoningConfig = msgspec.field(default_factory=ReasoningConfig)
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    text: TextOut = msgspec.field(default_factory=TextOut)
    truncation: str = "disabled"
    usage: Usage | None = None
    user: str | None = None


class ItemList(msgspec.Struct, kw_only=True):
    """`GET /v1/responses/{id}/input_items`: one page of a response's input items."""

    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


class Deleted(msgspec.Struct, kw_only=True):
    """`DELETE /v1/responses/{id}`'s answer."""

    id: str
    object: str = "response.deleted"
    deleted: bool = True


# -- stream events -----------------------------------------------------------------------
# Each carries its `type` as a field (the stream's `event:` line repeats it) and the
# stream-wide `sequence_number`.


class ResponseEvent(msgspec.Struct, kw_only=True):
    """response.created / in_progress / completed / incomplete / failed."""

    type: str
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(msgspec.Struct, kw_only=True):
    """response.output_item.added / done."""

    type: str
    sequence_number: int
    output_index: int
    item: Item


class ContentPartEvent(msgspec.Struct, kw_only=True):
    """response.content_part.added / done."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(msgspec.Struct, kw_only=True):
    """response.output_text.delta."""

    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)
    type: str = "response.output_text.delta"


class TextDoneEvent(msgspec.Struct, kw_only=True):
    """response.output_text.done."""

    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)
    type: str = "response.output_text.done"


class ReasoningDeltaEvent(msgspec.Struct, kw_only=True):
    """response.reasoning_text.delta."""

    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    type: str = "response.reasoning_text.delta"


class ReasoningDoneEvent(msgspec.Struct, kw_only=True):
    """response.reasoning_text.done."""

    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    type: str = "response.reasoning_text.done"


class ArgumentsDeltaEvent(msgspec.Struct, kw_only=True):
    """response.function_call_arguments.delta."""

    sequence_number: int
    item_id: str
    output_index: int
    delta: str
    type: str = "response.function_call_arguments.delta"


class ArgumentsDoneEvent(msgspec.Struct, kw_only=True):
    """response.function_call_arguments.done."""

    sequence_number: int
    item_id: str
    output_index: int
    arguments: str
    type: str = "response.function_call_arguments.done"


StreamEvent = (ResponseEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent
               | TextDoneEvent | ReasoningDeltaEvent | ReasoningDoneEvent
               | ArgumentsDeltaEvent | ArgumentsDoneEvent)
