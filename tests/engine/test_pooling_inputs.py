"""`ringserve.engine.frontend.pooling_inputs` without an engine: batch tokenization (a fake
tokenizer that records its calls, and a tiny real BERT tokenizer whose `tokenizer.json`
stores truncation and padding), pairs and their token types, truncation, the input checks,
Matryoshka `dimensions`, planning (one request, a too-long input, chunks) and combining
chunks into the token-weighted mean, and the cosine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from ringserve.config import PoolerConfig
from ringserve.engine.frontend.pooling_inputs import (
    InputPlan,
    PoolingJob,
    TokenizedInput,
    check_dimensions,
    check_token_ids,
    cosine_similarity,
    plan_inputs,
    tokenize_pairs,
    tokenize_texts,
    truncate_token_ids,
    truncation_length,
)
from ringserve.pooling_params import PoolingParams

CLS, SEP = 101, 102


class FakeTokenizer:
    """Words to ids (`len(word)`), `[CLS] ... [SEP]` around each text (and between a pair's
    texts, token types 1 on the second), and a record of every call."""

    def __init__(self, token_types: bool = True) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.token_types = token_types

    def __call__(self, texts: list[str], pairs: list[str] | None = None,
                 **kwargs: Any) -> dict[str, Any]:
        self.calls.append((texts, pairs, kwargs))
        special = kwargs.get("add_special_tokens", True)
        ids, types = [], []
        for i, text in enumerate(texts):
            first = [len(w) for w in text.split()]
            row = [CLS, *first, SEP] if special else first
            kinds = [0] * len(row)
            if pairs is not None:
                second = [len(w) for w in pairs[i].split()] + [SEP]
                row, kinds = row + second, kinds + [1] * len(second)
            if kwargs.get("truncation"):
                keep = kwargs["max_length"]
                row, kinds = [*row[:keep - 1], SEP], kinds[:keep]
            ids.append(row)
            types.append(kinds)
        out: dict[str, Any] = {"input_ids": ids}
        if self.token_types and pairs is not None:
            out["token_type_ids"] = types
        return out


def pooler(**kw: Any) -> PoolerConfig:
    values: dict[str, Any] = {"convert": "embed", "pooling_type": "MEAN", "normalize": True,
                              "encoder": True, "max_input_len": 8, **kw}
    return PoolerConfig(**values)


def test_texts_are_tokenized_in_one_batch_call() -> None:
    tok = FakeTokenizer()
    assert tokenize_texts(tok, ["a bb", "ccc", ""]) == [[CLS, 1, 2, SEP], [CLS, 3, SEP],
                                                         [CLS, SEP]]
    assert len(tok.calls) == 1
    assert tok.calls[0][2] == {"return_attention_mask": False, "return_token_type_ids": False,
                               "add_special_tokens": True}
    assert tokenize_texts(tok, ["a bb"], add_special_tokens=False) == [[1, 2]]
    assert tokenize_texts(tok, ["a bb ccc"], 3) == [[CLS, 1, SEP]]
    assert tok.calls[-1][2]["truncation"] is True and tok.calls[-1][2]["max_length"] == 3
    assert tokenize_texts(tok, []) == []


def test_pairs_carry_the_start_of_their_second_segment() -> None:
    tok = FakeTokenizer()
    pairs = tokenize_pairs(tok, ["a bb", "c"], ["ddd", "ee f"])
    assert pairs == [TokenizedInput([CLS, 1, 2, SEP, 3, SEP], 4),
                     TokenizedInput([CLS, 1, SEP, 2, 1, SEP], 3)]
    assert len(tok.calls) == 1
    assert tokenize_pairs(FakeTokenizer(token_types=False), ["a"], ["b"]) == [
        TokenizedInput([CLS, 1, SEP, 1, SEP], None)]
    with pytest.raises(ValueError, match="2 first texts against 1"):
        tokenize_pairs(tok, ["a", "b"], ["c"])


@pytest.mark.slow
def test_a_real_tokenizer_ignores_the_truncation_stored_in_tokenizer_json(
        tmp_path: Path) -> None:
    from transformers import AutoTokenizer, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat"]
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(str(tmp_path))
    stored = json.loads((tmp_path / "tokenizer.json").read_text())
    stored["truncation"] = {"direction": "Right", "max_length": 3, "strategy": "LongestFirst",
                            "stride": 0}
    stored["padding"] = {"strategy": {"Fixed": 10}, "direction": "Right",
                         "pad_to_multiple_of": None, "pad_id": 0, "pad_type_id": 0,
                         "pad_token": "[PAD]"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(stored))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tokenize_texts(tok, ["the cat sat on the mat", "cat"]) == [
        [2, 5, 6, 7, 8, 5, 9, 3], [2, 6, 3]]
    assert tokenize_texts(tok, ["the cat sat on the mat"], 4) == [[2, 5, 6, 3]]
    assert tokenize_pairs(tok, ["the cat"], ["on mat"]) == [
        TokenizedInput([2, 5, 6, 3, 8, 9, 3], 4)]


def test_truncation_length() -> None:
    model = pooler(max_input_len=512)
    assert truncation_length(None, model) is None
    assert truncation_length(-1, model) == 512
    assert truncation_length(7, model) == 7
    assert truncation_length(512, model) == 512
    for bad in (0, -2, 513):
        with pytest.raises(ValueError, match=r"^truncate_prompt_tokens: got .* 1 to 512"):
            truncation_length(bad, model)
    chunked = pooler(max_input_len=512, enable_chunked_processing=True, max_embed_len=2000)
    assert truncation_length(2000, chunked) == 2000
    assert truncation_length(-1, chunked) == 512
    with pytest.raises(ValueError, match="1 to 2000"):
        truncation_length(2001, chunked)
    assert truncation_length(10**6, pooler(enable_chunked_processing=True)) == 10**6


def test_token_id_inputs_keep_their_first_ids() -> None:
    assert truncate_token_ids([[1, 2, 3], [4]], 2) == [[1, 2], [4]]
    assert truncate_token_ids([[1, 2, 3]], None) == [[1, 2, 3]]


def test_input_checks_name_the_field() -> None:
    check_token_ids([[0, 5], [9]], 10, "input")
    with pytest.raises(ValueError, match=r"^input: got an empty list"):
        check_token_ids([], 10, "input")
    with pytest.raises(ValueError, match=r"^documents: document 1 is empty"):
        check_token_ids([[1], []], 10, "documents", "document")
    with pytest.raises(ValueError, match=r"^input: input 0 has token ids \[10, -1\] outside "
                                         r"the vocabulary \[0, 10\)"):
        check_token_ids([[1, 10, -1]], 10, "input")


def test_dimensions() -> None:
    check_dimensions(None, pooler(), 32)
    with pytest.raises(ValueError, match=r"^dimensions: this model is not a Matryoshka"):
        check_dimensions(8, pooler(), 32)
    check_dimensions(5, pooler(matryoshka_dimensions=()), 32)
    check_dimensions(32, pooler(matryoshka_dimensions=()), 32)
    with pytest.raises(ValueError, match=r"^dimensions: got 33, allowed: 1 to the hidden"):
        check_dimensions(33, pooler(matryoshka_dimensions=()), 32)
    check_dimensions(16, pooler(matryoshka_dimensions=(8, 16)), 32)
    with pytest.raises(ValueError, match=r"^dimensions: got 12, allowed: 8, 16"):
        check_dimensions(12, pooler(matryoshka_dimensions=(8, 16)), 32)


def test_plans_within_the_model_length() -> None:
    params = PoolingParams(task="score")
    plans = plan_inputs([TokenizedInput([1, 2, 3], 2), [4, 5]], params, pooler(), field="x")
    assert plans[0].jobs == (PoolingJob([1, 2, 3],
                                        PoolingParams(task="score", token_type_start=2)),)
    assert plans[1].jobs == (PoolingJob([4, 5], params),)
    assert [p.num_tokens for p in plans] == [3, 2]
    out = np.arange(3, dtype=np.float32)
    assert plans[0].combine([out]) is out


def test_too_long_inputs_name_the_length_and_the_way_out() -> None:
    with pytest.raises(ValueError, match=r"^input: input 1 has 9 tokens; this model takes at "
                                         r"most 8 \(set truncate_prompt_tokens, or "
                                         r"--pooler-config enable_chunked_processing\)"):
        plan_inputs([[1], [1] * 9], PoolingParams(), pooler(), field="input")
    # Chunking would not apply to a classification: the message does not offer it.
    with pytest.raises(ValueError, match=r"^text_2: pair 0 has 9 tokens; this model takes at "
                                         r"most 8 \(set truncate_prompt_tokens\)$"):
        plan_inputs([[1] * 9], PoolingParams(task="score"), pooler(convert="classify"),
                    field="text_2", noun="pair")
    with pytest.raises(ValueError, match="at most 8"):
        plan_inputs([[1] * 9], PoolingParams(task="token_embed"),
                    pooler(enable_chunked_processing=True), field="input")


def test_chunks_of_a_long_input_and_their_weighted_mean() -> None:
    model = pooler(max_input_len=4, enable_chunked_processing=True, max_embed_len=10)
    params = PoolingParams(dimensions=2)
    (plan,) = plan_inputs([list(range(10))], params, model, field="input")
    raw = msgspec.structs.replace(params, normalize=False, dimensions=None)
    assert plan.jobs == (PoolingJob([0, 1, 2, 3], raw), PoolingJob([4, 5, 6, 7], raw),
                         PoolingJob([8, 9], raw))
    assert plan.chunked and plan.normalize and plan.dimensions == 2 and plan.num_tokens == 10
    chunks = [np.array([1.0, 0.0, 5.0], np.float32), np.array([3.0, 2.0, 5.0], np.float32),
              np.array([0.0, 7.0, 5.0], np.float32)]
    mean = (4 * chunks[0] + 4 * chunks[1] + 2 * chunks[2]) / 10
    want = mean[:2] / np.linalg.norm(mean[:2])
    got = plan.combine(chunks)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6)
    (raw_plan,) = plan_inputs([list(range(10))], PoolingParams(normalize=False), model,
                              field="input")
    np.testing.assert_allclose(raw_plan.combine(chunks), mean, rtol=1e-6)
    with pytest.raises(ValueError, match=r"^input: input 0 has 11 tokens; this server embeds "
                                         r"at most max_embed_len=10"):
        plan_inputs([list(range(11))], params, model, field="input")
    with pytest.raises(ValueError, match="expected 3 outputs"):
        plan.combine(chunks[:2])


def test_plan_without_a_length_limit() -> None:
    (plan,) = plan_inputs([[1] * 100], PoolingParams(), pooler(max_input_len=0), field="input")
    assert plan == InputPlan((PoolingJob([1] * 100, PoolingParams()),), 100)


def test_cosine_similarity() -> None:
    a = np.array([1.0, 0.0], np.float32)
    assert cosine_similarity(a, np.array([2.0, 0.0], np.float32)) == pytest.approx(1.0)
    assert cosine_similarity(a, np.array([0.0, 3.0], np.float32)) == pytest.approx(0.0)
    assert cosine_similarity(a, np.array([-1.0, 1.0], np.float32)) == pytest.approx(-0.5 ** 0.5)
    assert cosine_similarity(a, np.zeros(2, np.float32)) == 0.0
