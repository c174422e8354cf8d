"""Tiny random pooling checkpoints for the tests, written with transformers and
sentence-transformers themselves (so their `SentenceTransformer` / `CrossEncoder` are the
oracle): a BERT sentence-transformers embedding model (Transformer, MEAN Pooling, Normalize),
BERT cross-encoders (`BertForSequenceClassification`), and decoder embedders (a tiny Qwen3 of
`ringserve.gpu.testing` under a sentence-transformers Pooling module). The WordPiece
vocabulary is made of syllable words generated here from a seed, so `sentence(n)` texts
tokenize to about n word tokens. Test support, like `ringserve.gpu.testing`: nothing in the
engine imports it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_SYLLABLES = ["ka", "ri", "to", "na", "me", "so", "lu", "ve", "an", "ter", "ing", "ed", "es",
              "ion", "al", "or", "en", "th", "re", "st", "pro", "con", "ment", "able"]
_RNG_SEED = 7


def words() -> list[str]:
    """The vocabulary's whole words (deterministic)."""
    rng = random.Random(_RNG_SEED)
    seen: dict[str, None] = {}
    while len(seen) < 300:
        seen["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))] = None
    return list(seen)


def sentence(num_words: int, seed: int) -> str:
    """A text of `num_words` vocabulary words (one token each)."""
    rng = random.Random(seed)
    vocab = words()
    return " ".join(rng.choice(vocab) for _ in range(num_words))


def _tokenizer(path: Path) -> Any:
    from transformers import BertTokenizerFast  # type: ignore[attr-defined]

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = [*SPECIALS, *words(), *letters, *(f"##{c}" for c in letters), ".", ",", "?"]
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})
    tokenizer.save_pretrained(str(path))
    return tokenizer


def _bert_config(vocab_size: int, **extra: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=512,
                      initializer_range=0.2, **extra)


def embedding_model(path: Path, *, max_seq_length: int = 64, seed: int = 0,
                    matryoshka: list[int] | None = None, normalize: bool = True) -> Path:
    """A sentence-transformers embedding model (BERT, MEAN pooling, Normalize when asked) in
    `path`; `matryoshka` goes into config.json's `matryoshka_dimensions`."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, Pooling, Transformer
    from transformers import BertModel

    base = path / "base"
    base.mkdir(parents=True)
    tokenizer = _tokenizer(base)
    extra = {"matryoshka_dimensions": matryoshka} if matryoshka else {}
    torch.manual_seed(seed)
    BertModel(_bert_config(len(tokenizer), **extra)).eval().save_pretrained(str(base))
    modules: list[Any] = [Transformer(str(base), max_seq_length=max_seq_length),
                          Pooling(32, pooling_mode="mean")]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(path / "model"))
    return path / "model"


def cross_encoder(path: Path, *, num_labels: int = 1, seed: int = 1) -> Path:
    """A BERT cross-encoder (`BertForSequenceClassification`) with `num_labels` labels in
    `path` (labels named `label_<i>` when there are several)."""
    import torch
    from transformers import BertForSequenceClassification

    path.mkdir(parents=True)
    tokenizer = _tokenizer(path)
    extra: dict[str, Any] = {"num_labels": num_labels}
    if num_labels > 1:
        extra["id2label"] = {i: f"label_{i}" for i in range(num_labels)}
        extra["label2id"] = {f"label_{i}": i for i in range(num_labels)}
    torch.manual_seed(seed)
    model = BertForSequenceClassification(_bert_config(len(tokenizer), **extra)).eval()
    model.save_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    return path


def decoder_embedding_model(path: Path, pooling_mode: str = "lasttoken", *,
                            normalize: bool = True) -> Path:
    """A sentence-transformers embedding model over the tiny Qwen3 decoder (saved as its base
    model, `Qwen3Model`, as sentence-transformers saves it) with `pooling_mode` ("lasttoken",
    "mean" or "cls") in `path`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, Pooling, Transformer

    from ringserve.gpu.testing import tiny_model

    transformer = Transformer(str(tiny_model("qwen3")))
    modules: list[Any] = [transformer, Pooling(transformer.get_word_embedding_dimension(),
                                               pooling_mode=pooling_mode)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return path


def decoder_classifier(path: Path, num_labels: int = 1) -> Path:
    """A `Qwen3ForSequenceClassification` over the tiny Qwen3's weights and tokenizer, with a
    random head of `num_labels` labels, in `path`."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen3ForSequenceClassification

    from ringserve.gpu.testing import tiny_model

    base = tiny_model("qwen3")
    config = AutoConfig.from_pretrained(str(base), num_labels=num_labels)
    config.architectures = ["Qwen3ForSequenceClassification"]
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    torch.manual_seed(num_labels)
    model = Qwen3ForSequenceClassification(config).eval()
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path
