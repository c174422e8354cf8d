"""The pooling routes' wire shapes without an engine: `input` in its four shapes, `/score`'s
pairing rules, unknown fields refused by name, vectors as JSON floats or little-endian
float32 base64, and the response bodies' fields."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import numpy as np
import pytest
from starlette.requests import Request

from ringserve.http.context import AppContext
from ringserve.http.errors import APIError
from ringserve.http.pooling.protocol import (
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    inputs_of,
    parse_body,
)
from ringserve.http.pooling.responses import (
    EmbeddingData,
    EmbeddingResponse,
    RerankResult,
    encode_vector,
    usage_of,
)
from ringserve.http.pooling.score import score_pairs


def test_inputs_of_each_shape() -> None:
    assert inputs_of("a") == ["a"]
    assert inputs_of(["a", "b"]) == ["a", "b"]
    assert inputs_of([1, 2]) == [[1, 2]]
    assert inputs_of([[1], [2, 3]]) == [[1], [2, 3]]
    assert inputs_of([[]]) == [[]]  # refused later as an empty input, with its index
    for bad in ([], ["a", 1], [True], [[1, "a"]], [None]):
        with pytest.raises(ValueError, match=r"^input: "):
            inputs_of(bad)


def test_score_pairs_follow_vllms_rules() -> None:
    assert score_pairs("q", ["a", "b"]) == (["q"], ["a", "b"])
    assert score_pairs(["q"], "a") == (["q"], ["a"])
    assert score_pairs(["x", "y"], ["a", "b"]) == (["x", "y"], ["a", "b"])
    with pytest.raises(ValueError, match=r"^text_1: 2 texts against 3 in text_2"):
        score_pairs(["x", "y"], ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"^text_1: 2 texts against 1"):
        score_pairs(["x", "y"], "a")
    with pytest.raises(ValueError, match=r"^text_1: got an empty list"):
        score_pairs([], "a")
    with pytest.raises(ValueError, match=r"^text_2: got an empty list"):
        score_pairs("a", [])


class _Ctx:
    """What `parse_body` uses of the app's context (its body decoding, which reads no
    state)."""

    async def parse(self, request: Request, kind: type[Any]) -> Any:
        return await AppContext.parse(self, request, kind)


def _request(body: dict[str, Any]) -> Request:
    payload = json.dumps(body).encode()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": payload, "more_body": False}

    return Request({"type": "http", "method": "POST", "headers": []}, receive)


async def test_unknown_and_mistyped_fields_are_400s_naming_them() -> None:
    ctx: Any = _Ctx()
    req = await parse_body(ctx, _request({"input": "a", "user": "u", "dimensions": 8}),
                           EmbeddingRequest, "/v1/embeddings")
    assert req.input == "a" and req.dimensions == 8 and req.encoding_format == "float"
    cases: list[tuple[type[Any], dict[str, Any], str]] = [
        (EmbeddingRequest, {"input": "a", "frobnicate": 1}, "frobnicate"),
        (EmbeddingRequest, {"input": "a", "encoding_format": "hex"}, "encoding_format"),
        (EmbeddingRequest, {"input": "a", "truncate_prompt_tokens": -5},
         "truncate_prompt_tokens"),
        (ScoreRequest, {"text_1": "a"}, "text_2"),
        (RerankRequest, {"query": "a", "documents": "b"}, "documents"),
    ]
    for kind, body, param in cases:
        with pytest.raises(APIError) as caught:
            await parse_body(ctx, _request(body), kind, "/route")
        assert caught.value.status == 400 and caught.value.param == param, caught.value.message
    with pytest.raises(APIError, match="frobnicate: this field is not supported by /route"):
        await parse_body(ctx, _request({"input": "a", "frobnicate": 1}), EmbeddingRequest,
                         "/route")


def test_vectors_as_floats_and_base64() -> None:
    vector = np.array([0.1, -2.5, 3e-8], np.float32)
    floats = encode_vector(vector, "float")
    assert floats == vector.tolist()
    assert np.array(floats, np.float32).tolist() == vector.tolist()
    text = encode_vector(vector, "base64")
    assert isinstance(text, str)
    assert np.frombuffer(base64.b64decode(text), "<f4").tolist() == vector.tolist()
    matrix = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert encode_vector(matrix, "float") == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    flat = np.frombuffer(base64.b64decode(str(encode_vector(matrix, "base64"))), "<f4")
    assert flat.tolist() == matrix.ravel().tolist()


def test_response_bodies_have_openais_fields() -> None:
    body = json.loads(msgspec.json.encode(EmbeddingResponse(
        id="embd-1", created=5, model="m",
        data=[EmbeddingData(index=0, embedding=[0.5])], usage=usage_of(3))))
    assert body == {"id": "embd-1", "created": 5, "model": "m", "object": "list",
                    "data": [{"index": 0, "embedding": [0.5], "object": "embedding"}],
                    "usage": {"prompt_tokens": 3, "total_tokens": 3}}
    assert json.loads(msgspec.json.encode(RerankResult(index=1, relevance_score=0.5))) == {
        "index": 1, "relevance_score": 0.5}
