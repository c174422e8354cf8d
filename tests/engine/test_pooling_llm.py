"""The pooling runner end to end through the offline `LLM` (`embed`, `encode`, `classify`,
`score`): parity with sentence-transformers for an encoder and for decoder embedders (their
prompts chunked, and for LAST pooling served from the prefix cache), chunked processing against
the token-weighted mean computed by hand, per-request failures that leave the engine serving,
and one runner per engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ringserve import LLM
from ringserve.engine.errors import EngineGenerateError
from ringserve.gpu.pooling.testing import (
    cross_encoder,
    decoder_classifier,
    decoder_embedding_model,
    embedding_model,
    sentence,
)
from ringserve.pooling_params import PoolingParams

pytestmark = pytest.mark.slow

TOL = 1e-4


def _close(ours: np.ndarray[Any, Any], ref: np.ndarray[Any, Any]) -> None:
    assert ours.shape == ref.shape
    assert float(np.abs(ours - ref).max()) <= TOL
    cos = (ours * ref).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(ref, axis=-1))
    assert float(cos.min()) >= 0.99999


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pooling-llm")


@pytest.fixture(scope="module")
def bert(root: Path) -> Path:
    return embedding_model(root / "bert", max_seq_length=64)


@pytest.fixture(scope="module")
def bert_llm(bert: Path) -> Iterator[LLM]:
    with LLM(str(bert), max_num_seqs=16) as llm:
        yield llm


def _texts() -> list[str]:
    return [sentence(n, seed=n) for n in (1, 3, 7, 12, 20, 33, 50, 60)]


def test_encoder_embeddings_match_sentence_transformers_in_a_mixed_batch(
        bert: Path, bert_llm: LLM) -> None:
    from sentence_transformers import SentenceTransformer

    texts = _texts()
    ref = SentenceTransformer(str(bert), device="cpu").encode(texts, convert_to_numpy=True)
    outs = bert_llm.embed(texts)
    assert [o.request_id for o in outs] == [str(i) for i in range(len(texts))]
    _close(np.array([o.outputs.embedding for o in outs], dtype=np.float32), ref)
    one = bert_llm.embed(texts[3])  # alone, as one request
    _close(np.array(one[0].outputs.embedding, dtype=np.float32), ref[3])


def test_token_prompts_truncation_and_per_token_outputs(bert_llm: LLM) -> None:
    tokenizer = bert_llm.get_tokenizer()
    ids = tokenizer(sentence(30, seed=5)).input_ids
    whole = bert_llm.embed({"prompt_token_ids": ids})[0]
    assert whole.prompt_token_ids == ids
    cut = bert_llm.embed({"prompt_token_ids": ids}, truncate_prompt_tokens=10)[0]
    assert cut.prompt_token_ids == ids[:10]
    again = bert_llm.embed({"prompt_token_ids": ids[:10]})[0]
    assert cut.outputs.embedding == again.outputs.embedding
    tokens = bert_llm.encode({"prompt_token_ids": ids}, pooling_task="token_embed")[0]
    data = tokens.outputs.data
    assert data.shape == (len(ids), 32)
    np.testing.assert_allclose(np.linalg.norm(data, axis=1), 1.0, atol=1e-5)


def test_a_failed_request_fails_alone_and_the_engine_keeps_serving(bert_llm: LLM) -> None:
    # Past the hidden size: the frontend's check is skipped by encode, the worker refuses it.
    with pytest.raises(EngineGenerateError, match="dimensions"):
        bert_llm.encode("some text", PoolingParams(dimensions=500))
    with pytest.raises(ValueError, match="not a Matryoshka"):
        bert_llm.embed("some text", pooling_params=PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="at most 64"):
        bert_llm.embed({"prompt_token_ids": [5] * 65})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bert_llm.embed({"prompt_token_ids": [5, 10**6]})
    with pytest.raises(ValueError, match="not a classifier"):
        bert_llm.classify("some text")
    with pytest.raises(ValueError, match="pooling model"):
        bert_llm.generate("some text", use_tqdm=False)
    assert len(bert_llm.embed(["still", "serving"])) == 2


def test_chunked_processing_is_the_token_weighted_mean_of_the_chunks(bert: Path) -> None:
    with LLM(str(bert), max_model_len=16,
             pooler_config={"enable_chunked_processing": True}) as llm:
        ids = llm.get_tokenizer()(sentence(40, seed=9)).input_ids
        assert len(ids) > 32
        chunks = [ids[i:i + 16] for i in range(0, len(ids), 16)]
        raw = [llm.encode({"prompt_token_ids": c}, PoolingParams(normalize=False))[0]
               .outputs.data.astype(np.float64) for c in chunks]
        weights = np.array([len(c) for c in chunks], dtype=np.float64)
        mean = (weights[:, None] * np.stack(raw)).sum(0) / weights.sum()
        expected = mean / np.linalg.norm(mean)
        got = np.array(llm.embed({"prompt_token_ids": ids})[0].outputs.embedding)
        np.testing.assert_allclose(got, expected, atol=1e-5)


def _st_forward(model_dir: Path, texts: list[str]) -> np.ndarray[Any, Any]:
    """sentence-transformers' embedding of each text's plain tokenization (its own
    `encode` would wrap a decoder's text in the tokenizer's chat template first)."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_dir), device="cpu")
    rows = []
    for text in texts:
        ids = torch.tensor([st.tokenizer(text).input_ids])
        with torch.no_grad():
            out = st.forward({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        rows.append(out["sentence_embedding"][0].numpy())
    return np.stack(rows)


@pytest.mark.parametrize("mode", ["lasttoken", "mean"])
def test_decoder_embedders_match_with_chunked_prompts(root: Path, mode: str) -> None:
    model = decoder_embedding_model(root / f"decoder-{mode}", mode)
    texts = [f"the quick brown fox {i} " * (1 + 3 * i) for i in range(4)]
    ref = _st_forward(model, texts)
    # A 16-token budget: the longer prompts run in several chunks.
    with LLM(str(model), max_num_batched_tokens=16, max_num_seqs=4) as llm:
        got = np.array([o.outputs.embedding for o in llm.embed(texts)], dtype=np.float32)
        _close(got, ref)
        again = np.array([o.outputs.embedding for o in llm.embed(texts)], dtype=np.float32)
        _close(again, ref)  # LAST pooling: served from the prefix cache the second time


def test_cross_encoder_scores_and_classification(root: Path) -> None:
    from sentence_transformers import CrossEncoder

    model = cross_encoder(root / "cross")
    query = sentence(4, seed=1)
    docs = [sentence(n, seed=10 + n) for n in (3, 9, 15)]
    ref = CrossEncoder(str(model), device="cpu").predict([(query, d) for d in docs])
    with LLM(str(model)) as llm:
        scores = [o.outputs.score for o in llm.score(query, docs)]
        np.testing.assert_allclose(scores, ref, atol=TOL)
        with pytest.raises(ValueError, match="data_1 / data_2"):
            llm.score([query, query], docs)
        probs = llm.classify(docs)
        assert [o.outputs.num_classes for o in probs] == [1, 1, 1]

    three = cross_encoder(root / "cross3", num_labels=3)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    hf = AutoModelForSequenceClassification.from_pretrained(str(three)).eval()
    tok = AutoTokenizer.from_pretrained(str(three))
    with torch.no_grad():
        expected = [torch.softmax(hf(**tok(d, return_tensors="pt")).logits[0], -1).numpy()
                    for d in docs]
    with LLM(str(three)) as llm:
        got = [o.outputs.probs for o in llm.classify(docs)]
    np.testing.assert_allclose(np.array(got), np.stack(expected), atol=TOL)


def test_a_generation_model_does_not_pool() -> None:
    with LLM(None, max_model_len=64) as llm, pytest.raises(ValueError, match="generates text"):
        llm.embed("hello")


@pytest.mark.parametrize("num_labels", [1, 3])
def test_decoder_classifier_matches_transformers(root: Path, num_labels: int) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = decoder_classifier(root / f"qwen3-cls-{num_labels}", num_labels)
    texts = [f"is the river {i} deep " * (1 + 2 * i) for i in range(3)]
    hf = AutoModelForSequenceClassification.from_pretrained(str(model)).eval()
    tok = AutoTokenizer.from_pretrained(str(model))
    with torch.no_grad():
        logits = [hf(**tok(t, return_tensors="pt")).logits[0] for t in texts]
    act = torch.sigmoid if num_labels == 1 else (lambda x: torch.softmax(x, -1))
    expected = np.stack([act(x).numpy() for x in logits])
    with LLM(str(model), max_num_batched_tokens=16, max_num_seqs=4) as llm:
        got = np.array([o.outputs.probs for o in llm.classify(texts)], dtype=np.float32)
        np.testing.assert_allclose(got, expected, atol=TOL)
        if num_labels == 1:
            scores = [o.outputs.score for o in llm.score(texts[0], texts[1:])]
            assert len(scores) == 2 and all(0.0 < x < 1.0 for x in scores)
