"""Chunked processing on a live server (`--max-model-len 16`, `--pooler-config` with
`enable_chunked_processing` and `max_embed_len` 100) of a tiny BERT embedding model that is
not Matryoshka: a long input's embedding equals the token-weighted mean of its chunks' mean
hidden states computed by hand with transformers (chunks of 16 tokens, each from position 0,
no special tokens added again), normalised; `max_embed_len` and `dimensions` are 400s naming
them. Then a generation server answers every pooling route with a 400."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from http_app_harness import serving
from pooling_server import PoolingServer, error_of

from ringserve.gpu.pooling.testing import embedding_model, sentence

pytestmark = pytest.mark.slow  # one server for the module (~8 s), transformers' model

CHUNK = 16
MAX_EMBED_LEN = 100


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return embedding_model(tmp_path_factory.mktemp("emb"), seed=3, max_seq_length=512)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolingServer]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    pooler = json.dumps({"enable_chunked_processing": True, "max_embed_len": MAX_EMBED_LEN})
    with PoolingServer(model_dir, log, ("--max-model-len", str(CHUNK),
                                        "--pooler-config", pooler)) as live:
        yield live


def by_hand(model_dir: Path, text: str, normalize: bool) -> tuple[np.ndarray[Any, Any], int]:
    """vLLM's chunked rule with transformers: the input's ids cut into chunks, each run alone
    from position 0, mean-pooled, then the mean weighted by chunk length."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir))(text)["input_ids"]
    model = AutoModel.from_pretrained(str(model_dir)).eval()
    total = np.zeros(32)
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start:start + CHUNK]
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([chunk])).last_hidden_state[0]
        total += hidden.double().mean(dim=0).numpy() * len(chunk)
    mean = total / len(ids)
    return (mean / np.linalg.norm(mean) if normalize else mean), len(ids)


def close(got: Any, want: Any) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    cos = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert cos >= 0.99999, cos
    assert float(np.abs(got - want).max()) <= 1e-4


def test_long_inputs_are_the_token_weighted_mean_of_their_chunks(server: PoolingServer,
                                                                 model_dir: Path) -> None:
    long_text, short_text = sentence(57, seed=1), sentence(5, seed=2)  # 59 tokens: 4 chunks
    want, length = by_hand(model_dir, long_text, normalize=True)
    assert length == 59
    response = server.post("/v1/embeddings", {"input": [short_text, long_text]})
    assert response.status_code == 200, response.text
    body = response.json()
    close(body["data"][1]["embedding"], want)
    close(body["data"][0]["embedding"], by_hand(model_dir, short_text, normalize=True)[0])
    assert body["usage"]["prompt_tokens"] == 59 + 7
    raw = server.post("/v1/embeddings", {"input": long_text, "normalize": False})
    close(raw.json()["data"][0]["embedding"], by_hand(model_dir, long_text, normalize=False)[0])
    # Cosine scores use the chunked embeddings too.
    score = server.post("/score", {"text_1": long_text, "text_2": long_text})
    assert score.json()["data"][0]["score"] == pytest.approx(1.0, abs=1e-6)


def test_limits_of_chunking(server: PoolingServer) -> None:
    too_long = sentence(MAX_EMBED_LEN, seed=3)  # 102 tokens
    message = error_of(server.post("/v1/embeddings", {"input": ["a", too_long]}),
                       param="input")
    assert "input 1 has 102 tokens" in message and "max_embed_len=100" in message
    truncated = server.post("/v1/embeddings", {"input": too_long,
                                               "truncate_prompt_tokens": MAX_EMBED_LEN})
    assert truncated.status_code == 200, truncated.text
    # Per-token outputs are not chunked: the model's length holds.
    message = error_of(server.post("/pooling", {"input": sentence(20, seed=4),
                                                "task": "token_embed"}), param="input")
    assert f"at most {CHUNK}" in message
    message = error_of(server.post("/v1/embeddings", {"input": "a", "dimensions": 8}),
                       param="dimensions")
    assert "not a Matryoshka model" in message


async def test_a_generation_server_refuses_the_pooling_routes(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir) as s:
        bodies: dict[str, dict[str, Any]] = {
            "/v1/embeddings": {"input": "a"}, "/pooling": {"input": "a"},
            "/classify": {"input": "a"}, "/score": {"text_1": "a", "text_2": "b"},
            "/v1/score": {"text_1": "a", "text_2": "b"},
            "/rerank": {"query": "a", "documents": ["b"]},
            "/v1/rerank": {"query": "a", "documents": ["b"]},
            "/v2/rerank": {"query": "a", "documents": ["b"]},
        }
        for path, body in bodies.items():
            message = error_of(await s.http.post(path, json=body), param="model")
            assert "does not support pooling" in message
        completion = await s.http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert completion.status_code == 200, completion.text
