"""`/score`, `/rerank` and `/classify` on classification models: a live server of a tiny
random BERT cross-encoder (`BertForSequenceClassification`, one label) against
`sentence_transformers.CrossEncoder.predict` (one against many, pairwise, truncated, raw
logits; reranked order, `top_n`, `return_documents`, the three rerank paths), and an
in-process engine on a three-label classifier against transformers' softmax and its
`id2label`; bad inputs are 400s naming their field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from http_app_harness import serving
from pooling_server import MODEL, PoolingServer, error_of

from ringserve.gpu.pooling.testing import cross_encoder, sentence

pytestmark = pytest.mark.slow  # one server for the module (~8 s), the oracle's import

QUERY = sentence(6, seed=20)
DOCS = [sentence(n, seed=30 + n) for n in (3, 9, 17, 40, 2)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cross_encoder(tmp_path_factory.mktemp("ce") / "model")


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> Any:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolingServer]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with PoolingServer(model_dir, log) as live:  # the runner is chosen from the checkpoint
        yield live


def scores(response: Any) -> list[float]:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return [d["score"] for d in data]


def test_score_matches_cross_encoder_predict(server: PoolingServer, oracle: Any) -> None:
    want = oracle.predict([(QUERY, d) for d in DOCS])
    one_to_many = server.post("/score", {"text_1": QUERY, "text_2": DOCS})
    np.testing.assert_allclose(scores(one_to_many), want, atol=1e-5)
    body = one_to_many.json()
    assert body["id"].startswith("score-") and body["model"] == MODEL
    pair_tokens = [len(ids) for ids in oracle.tokenizer([QUERY] * len(DOCS), DOCS)["input_ids"]]
    assert body["usage"] == {"prompt_tokens": sum(pair_tokens), "total_tokens": sum(pair_tokens)}
    firsts = [DOCS[0], DOCS[1], QUERY]
    pairwise = server.post("/v1/score", {"text_1": firsts, "text_2": DOCS[2:]})
    np.testing.assert_allclose(scores(pairwise),
                               oracle.predict(list(zip(firsts, DOCS[2:], strict=True))),
                               atol=1e-5)
    single = server.post("/score", {"text_1": QUERY, "text_2": DOCS[3]})
    assert scores(single) == pytest.approx([float(want[3])], abs=1e-5)
    raw = server.post("/score", {"text_1": QUERY, "text_2": DOCS, "activation": False})
    np.testing.assert_allclose(scores(raw), np.log(want / (1 - want)), atol=1e-4)


def test_truncated_pairs_match_a_truncating_cross_encoder(server: PoolingServer,
                                                          model_dir: Path) -> None:
    from sentence_transformers import CrossEncoder

    short = CrossEncoder(str(model_dir), device="cpu", max_length=12)
    want = short.predict([(QUERY, d) for d in DOCS])
    got = server.post("/score", {"text_1": QUERY, "text_2": DOCS, "truncate_prompt_tokens": 12})
    np.testing.assert_allclose(scores(got), want, atol=1e-5)
    assert got.json()["usage"]["prompt_tokens"] == sum(min(12, n) for n in (
        len(ids) for ids in short.tokenizer([QUERY] * len(DOCS), DOCS)["input_ids"]))


def test_rerank_orders_by_relevance(server: PoolingServer, oracle: Any) -> None:
    want = oracle.predict([(QUERY, d) for d in DOCS])
    order = [int(i) for i in np.argsort(-want)]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        response = server.post(path, {"query": QUERY, "documents": DOCS})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["id"].startswith("rerank-") and body["model"] == MODEL
        assert [r["index"] for r in body["results"]] == order
        for r in body["results"]:
            assert r["relevance_score"] == pytest.approx(float(want[r["index"]]), abs=1e-5)
            assert r["document"] == {"text": DOCS[r["index"]]}
        assert body["usage"]["total_tokens"] > 0
    top = server.post("/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2,
                                  "return_documents": False}).json()["results"]
    assert [r["index"] for r in top] == order[:2]
    assert all("document" not in r for r in top)


def test_classify_on_a_cross_encoder_and_bad_inputs(server: PoolingServer,
                                                    oracle: Any) -> None:
    import torch

    response = server.post("/classify", {"input": [QUERY, DOCS[0]]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("classify-") and body["object"] == "list"
    encoded = oracle.tokenizer([QUERY, DOCS[0]], padding=True, return_tensors="pt")
    with torch.no_grad():  # each text on its own: [CLS] text [SEP]
        alone = torch.sigmoid(oracle.transformers_model(**encoded).logits[:, 0]).numpy()
    for item, expected in zip(body["data"], alone, strict=True):
        assert item["label"] == "LABEL_0" and item["num_classes"] == 1
        assert item["probs"] == pytest.approx([float(expected)], abs=1e-5)
    pooled = server.post("/pooling", {"input": QUERY})
    assert pooled.json()["data"][0]["data"] == body["data"][0]["probs"]
    long_doc = sentence(520, seed=1)
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/embeddings", {"input": "a"}, "model"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_1"),
        ("/score", {"text_1": "a", "text_2": [long_doc]}, "text_2"),
        ("/score", {"text_1": "a", "text_2": "b", "normalize": True}, "normalize"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
        ("/rerank", {"query": "a", "documents": ["b", long_doc]}, "documents"),
        ("/rerank", {"documents": ["b"]}, "query"),
        ("/classify", {"input": []}, "input"),
        ("/pooling", {"input": "a", "task": "embed"}, "task"),
    ]
    for path, body_in, param in cases:
        error_of(server.post(path, body_in), param=param)
    assert "is a classification model" in error_of(server.post("/v1/embeddings",
                                                               {"input": "a"}))
    assert server.http.get("/health").status_code == 200


async def test_classify_labels_of_a_three_label_classifier(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir = cross_encoder(tmp_path / "clf", num_labels=3, seed=4)
    texts = [sentence(n, seed=40 + n) for n in (2, 5, 11)]
    encoded = AutoTokenizer.from_pretrained(str(model_dir))(texts, padding=True,
                                                           return_tensors="pt")
    with torch.no_grad():
        logits = AutoModelForSequenceClassification.from_pretrained(
            str(model_dir))(**encoded).logits
    want = torch.softmax(logits, dim=-1).numpy()
    async with serving(model_dir, executor="default", max_model_len=None) as s:
        response = await s.http.post("/classify", json={"input": texts})
    assert response.status_code == 200, response.text
    for item, expected in zip(response.json()["data"], want, strict=True):
        np.testing.assert_allclose(item["probs"], expected, atol=1e-5)
        assert item["label"] == f"label_{int(np.argmax(expected))}"
        assert item["num_classes"] == 3
