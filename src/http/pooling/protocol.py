"""Request bodies of the pooling routes (OpenAI's `/v1/embeddings` fields plus vLLM's extras,
and vLLM's `/pooling`, `/classify`, `/score` and `/rerank` bodies).

msgspec Structs decoded by `parse_body`: a wrong type is a 400 naming its path, and a field
these routes do not know is a 400 naming it (`forbid_unknown_fields`: a field that could
change the answer must not be dropped silently). `input` is a string, a list of strings, a
list of token ids or a list of token-id lists; msgspec unions allow one array type only, so it
decodes as `str | list[Any]` and `inputs_of` sorts it out.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from starlette.requests import Request

from ringserve.http.context import AppContext
from ringserve.http.errors import APIError, bad_request
from ringserve.http.protocol import Int64

T = TypeVar("T")

EncodingFormat = Literal["float", "base64"]
# `truncate_prompt_tokens`: -1 (the model's length) or a positive count (checked with the
# model's length by `pooling_inputs.truncation_length`).
TruncatePromptTokens = Annotated[int, msgspec.Meta(ge=-1)]

_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")


class _Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields every pooling body takes."""

    model: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    user: str | None = None  # accepted and ignored, as OpenAI does
    priority: Int64 = 0
    request_id: str | None = None


class EmbeddingRequest(_Body, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/embeddings`."""

    input: str | list[Any]
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True


class PoolingRequest(_Body, kw_only=True, forbid_unknown_fields=True):
    """`POST /pooling`: `task` None is the model's own (embed, or classify for a
    classifier)."""

    input: str | list[Any]
    task: Literal["embed", "token_embed", "classify"] | None = None
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    add_special_tokens: bool = True


class ClassificationRequest(_Body, kw_only=True, forbid_unknown_fields=True):
    """`POST /classify`."""

    input: str | list[Any]
    activation: bool | None = None
    add_special_tokens: bool = True


class ScoreRequest(_Body, kw_only=True, forbid_unknown_fields=True):
    """`POST /score`: `text_1` against `text_2` (one against many, or pairwise)."""

    text_1: str | list[str]
    text_2: str | list[str]
    activation: bool | None = None


class RerankRequest(_Body, kw_only=True, forbid_unknown_fields=True):
    """`POST /rerank` (Jina's and Cohere's fields)."""

    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True
    activation: bool | None = None


async def parse_body(ctx: AppContext, request: Request, kind: type[T], route: str) -> T:
    """The decoded body of a pooling route.

    Raises:
        APIError: 400 for malformed JSON, a field of the wrong type (its path named) or a
            field this route does not know (named).
    """
    try:
        return await ctx.parse(request, kind)
    except APIError as error:
        match = _UNKNOWN_FIELD.search(error.message)
        if match is None:
            raise
        name = ".".join(p for p in (match.group(2), match.group(1)) if p)
        raise bad_request(f"{name}: this field is not supported by {route}; leave it out",
                          name) from None


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def inputs_of(value: str | list[Any], field: str = "input") -> list[str] | list[list[int]]:
    """The inputs of a request: texts, or token-id lists (never both).

    Raises:
        ValueError: an empty list, or a list that is none of the allowed shapes (naming
            `field`).
    """
    allowed = ("allowed: a string, a list of strings, a list of token ids or a list of "
               "token-id lists")
    if isinstance(value, str):
        return [value]
    if not value:
        raise ValueError(f"{field}: got an empty list; {allowed}")
    if all(isinstance(v, str) for v in value):
        return list(value)
    if all(_is_id(v) for v in value):
        return [list(value)]
    if all(isinstance(v, list) and all(_is_id(t) for t in v) for v in value):
        return [list(v) for v in value]
    raise ValueError(f"{field}: {allowed} (not a mixture)")
