"""`/v1/embeddings` and `/pooling` on a live `ringserve serve` of a tiny random BERT
sentence-transformers model (MEAN pooling, Normalize, Matryoshka dimensions 8 and 16):
parity with `SentenceTransformer.encode` one at a time and in a mixed batch of 3 to 512
tokens, base64 equal to the float answer, the official openai client (float and its default
base64), Matryoshka truncation, truncation, `/pooling`'s per-token states against
transformers, the cosine `/score` and `/rerank` of an embedding model, and every bad input as
a 400 naming its field while the server keeps serving; the generation routes answer a 400
saying the model is a pooling model."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from pooling_server import MODEL, PoolingServer, error_of

from ringserve.gpu.pooling.testing import embedding_model, sentence

pytestmark = pytest.mark.slow  # one server for the module (~8 s), the oracle's import

HIDDEN = 32
MATRYOSHKA = [8, 16]


def close(got: Any, want: Any) -> None:
    """The parity tolerance of issue 43: cosine >= 0.99999, max abs difference <= 1e-4."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    cos = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert cos >= 0.99999, cos
    assert float(np.abs(got - want).max()) <= 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return embedding_model(tmp_path_factory.mktemp("emb"), matryoshka=MATRYOSHKA,
                           max_seq_length=512)


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolingServer]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with PoolingServer(model_dir, log, ("--runner", "pooling")) as live:
        yield live


def vectors(response: Any) -> list[list[float]]:
    assert response.status_code == 200, response.text
    body = response.json()
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return [d["embedding"] for d in body["data"]]


def test_one_at_a_time_and_mixed_batch_match_sentence_transformers(
        server: PoolingServer, oracle: Any) -> None:
    texts = [sentence(n, seed=n) for n in (1, 2, 7, 30, 100, 255, 510)]
    want = oracle.encode(texts, batch_size=32)
    for text, expected in zip(texts[:3], want[:3], strict=True):
        close(vectors(server.post("/v1/embeddings", {"input": text}))[0], expected)
    response = server.post("/v1/embeddings", {"input": texts})
    for got, expected in zip(vectors(response), want, strict=True):
        close(got, expected)
    body = response.json()
    lengths = [len(ids) for ids in oracle.tokenizer(texts)["input_ids"]]
    assert lengths[-1] == 512
    assert body["usage"] == {"prompt_tokens": sum(lengths), "total_tokens": sum(lengths)}
    assert body["object"] == "list" and body["model"] == MODEL
    assert body["id"].startswith("embd-") and isinstance(body["created"], int)
    assert body["data"][0]["object"] == "embedding"


def test_token_id_inputs_and_base64(server: PoolingServer, oracle: Any) -> None:
    texts = [sentence(5, seed=1), sentence(9, seed=2)]
    ids = [list(x) for x in oracle.tokenizer(texts)["input_ids"]]
    floats = vectors(server.post("/v1/embeddings", {"input": texts}))
    assert vectors(server.post("/v1/embeddings", {"input": ids})) == floats
    assert vectors(server.post("/v1/embeddings", {"input": ids[0]})) == floats[:1]
    encoded = vectors(server.post("/v1/embeddings", {"input": texts,
                                                     "encoding_format": "base64"}))
    decoded = [np.frombuffer(base64.b64decode(e), dtype="<f4") for e in encoded]
    assert [d.tolist() for d in decoded] == [np.float32(f).tolist() for f in floats]


def test_openai_client_parses_float_and_base64(server: PoolingServer, oracle: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    texts = [sentence(4, seed=3), sentence(12, seed=4)]
    want = oracle.encode(texts)
    # The client asks for base64 (and decodes it) unless told otherwise.
    for fmt in (openai.NOT_GIVEN, "float"):
        result = client.embeddings.create(model=MODEL, input=texts, encoding_format=fmt)
        assert [d.index for d in result.data] == [0, 1]
        for got, expected in zip(result.data, want, strict=True):
            close(got.embedding, expected)
        assert result.usage.prompt_tokens == result.usage.total_tokens > 0
    short = client.embeddings.create(model=MODEL, input=texts[0], dimensions=8)
    assert len(short.data[0].embedding) == 8


def test_matryoshka_dimensions_truncate_then_renormalise(server: PoolingServer,
                                                         oracle: Any) -> None:
    text = sentence(20, seed=5)
    full = oracle.encode([text])[0]
    for dims in MATRYOSHKA:
        got = vectors(server.post("/v1/embeddings", {"input": text, "dimensions": dims}))[0]
        expected = full[:dims] / np.linalg.norm(full[:dims])
        close(got, expected)
    for dims, allowed in ((12, "8, 16"), (HIDDEN + 1, "8, 16"), (0, "1 to the hidden")):
        message = error_of(server.post("/v1/embeddings", {"input": text, "dimensions": dims}),
                           param="dimensions")
        assert allowed in message or "hidden size" in message, message


def test_normalize_false_gives_the_raw_mean(server: PoolingServer, oracle: Any) -> None:
    text = sentence(6, seed=6)
    raw = vectors(server.post("/v1/embeddings", {"input": text, "normalize": False}))[0]
    mean = oracle.encode([text], output_value="token_embeddings")[0].numpy().mean(axis=0)
    close(raw, mean)
    assert abs(float(np.linalg.norm(raw)) - 1.0) > 1e-3


def test_truncate_prompt_tokens(server: PoolingServer, oracle: Any) -> None:
    long_text = sentence(600, seed=7)
    message = error_of(server.post("/v1/embeddings", {"input": ["a", long_text]}),
                       param="input")
    assert "input 1 has 602 tokens" in message and "at most 512" in message
    assert "truncate_prompt_tokens" in message
    # -1: the model's length; the tokenizer keeps the end special token, as
    # sentence-transformers truncates.
    got = vectors(server.post("/v1/embeddings", {"input": long_text,
                                                 "truncate_prompt_tokens": -1}))[0]
    close(got, oracle.encode([long_text])[0])
    response = server.post("/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": 10})
    assert response.json()["usage"]["prompt_tokens"] == 10
    oracle_short = oracle.tokenizer([long_text], truncation=True, max_length=10)["input_ids"][0]
    assert oracle_short[-1] == oracle.tokenizer.sep_token_id
    ids = oracle.tokenizer([long_text])["input_ids"][0]
    by_ids = server.post("/v1/embeddings", {"input": ids, "truncate_prompt_tokens": 10})
    assert by_ids.json()["usage"]["prompt_tokens"] == 10
    for bad in (0, -2, 513):
        error_of(server.post("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": bad}),
                 param="truncate_prompt_tokens")


def test_pooling_route(server: PoolingServer, model_dir: Path) -> None:
    import torch
    from transformers import AutoModel, AutoTokenizer

    text = sentence(7, seed=8)
    embed = server.post("/pooling", {"input": [text]})
    assert embed.status_code == 200, embed.text
    body = embed.json()
    assert body["id"].startswith("pool-") and body["object"] == "list"
    assert body["data"][0]["object"] == "pooling"
    assert body["data"][0]["data"] == vectors(server.post("/v1/embeddings", {"input": text}))[0]
    tokens = server.post("/pooling", {"input": text, "task": "token_embed", "normalize": False})
    assert tokens.status_code == 200, tokens.text
    states = np.array(tokens.json()["data"][0]["data"])
    ids = AutoTokenizer.from_pretrained(str(model_dir))([text], return_tensors="pt")
    with torch.no_grad():
        want = AutoModel.from_pretrained(str(model_dir))(**ids).last_hidden_state[0].numpy()
    assert states.shape == want.shape == (9, HIDDEN)
    for got_row, want_row in zip(states, want, strict=True):
        close(got_row, want_row)
    b64 = server.post("/pooling", {"input": text, "task": "token_embed", "normalize": False,
                                   "encoding_format": "base64"}).json()["data"][0]["data"]
    flat = np.frombuffer(base64.b64decode(b64), dtype="<f4")
    assert flat.tolist() == np.float32(states).ravel().tolist()
    error_of(server.post("/pooling", {"input": text, "task": "classify"}), param="task")
    error_of(server.post("/pooling", {"input": text, "task": "nope"}), param="task")


def test_score_and_rerank_are_cosines(server: PoolingServer, oracle: Any) -> None:
    query, docs = sentence(5, seed=9), [sentence(n, seed=10 + n) for n in (3, 8, 20)]
    q, d = oracle.encode([query]), oracle.encode(docs)
    want = (d @ q[0]) / (np.linalg.norm(d, axis=1) * np.linalg.norm(q[0]))
    score = server.post("/score", {"text_1": query, "text_2": docs})
    assert score.status_code == 200, score.text
    body = score.json()
    assert body["id"].startswith("score-") and body["object"] == "list"
    assert [x["index"] for x in body["data"]] == [0, 1, 2]
    assert all(x["object"] == "score" for x in body["data"])
    np.testing.assert_allclose([x["score"] for x in body["data"]], want, atol=1e-5)
    pairwise = server.post("/v1/score", {"text_1": [query, docs[0]], "text_2": docs[:2]})
    assert pairwise.status_code == 200, pairwise.text
    assert pairwise.json()["data"][0]["score"] == pytest.approx(float(want[0]), abs=1e-5)
    rerank = server.post("/rerank", {"query": query, "documents": docs, "top_n": 2})
    assert rerank.status_code == 200, rerank.text
    results = rerank.json()["results"]
    order = list(np.argsort(-want))
    assert [r["index"] for r in results] == order[:2]
    assert results[0]["document"] == {"text": docs[order[0]]}


def test_bad_inputs_are_400s_naming_the_field(server: PoolingServer) -> None:
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": [[]]}, "input"),
        ("/v1/embeddings", {"input": [1, 2, 10**6]}, "input"),
        ("/v1/embeddings", {"input": [[1, 2], [-1]]}, "input"),
        ("/v1/embeddings", {"input": ["a", 5]}, "input"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ("/v1/embeddings", {"input": "a", "frobnicate": True}, "frobnicate"),
        ("/pooling", {"input": "a", "frobnicate": True}, "frobnicate"),
        ("/v1/embeddings", {}, "input"),
        ("/classify", {"input": "a"}, "model"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
        ("/score", {"text_1": [], "text_2": "a"}, "text_1"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ]
    for path, body, param in cases:
        error_of(server.post(path, body), param=param)
    assert "not a classification model" in error_of(server.post("/classify", {"input": "a"}))
    assert server.post("/v1/embeddings", {"input": ""}).status_code == 200  # [CLS] [SEP]
    error_of(server.post("/v1/embeddings", {"model": "other", "input": "a"}), 404)


def test_generation_routes_say_this_is_a_pooling_model(server: PoolingServer) -> None:
    for path, body in (("/v1/completions", {"prompt": "a"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "a"}]}),
                       ("/v1/responses", {"input": "a"})):
        assert "is a pooling model" in error_of(server.post(path, body), param="model")
    messages = server.http.post("/v1/messages", json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "a"}]})
    assert messages.status_code == 400, messages.text
    assert "is a pooling model" in messages.text
    assert server.http.get("/health").status_code == 200


def test_models_and_tokenize_report_the_longest_input(server: PoolingServer) -> None:
    # The engine's context holds one slot more than the longest input (the token a pooling
    # request books and never samples); users see the model's length.
    card = server.http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == 512
