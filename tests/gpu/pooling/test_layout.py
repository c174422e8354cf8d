"""The pooler a checkpoint's files describe (`ringserve.gpu.pooling.layout`): sentence-
transformers' `modules.json` in its classic and >= 5 forms (files as the published
all-MiniLM-L6-v2 and sentence-transformers 6.3 write them), the defaults without it,
`--convert`, `--pooler-config`, Matryoshka dimensions and classifier labels.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ringserve.errors import ModelDirectoryError
from ringserve.gpu.pooling.layout import (
    ENCODER_ARCHITECTURES,
    classifier_labels,
    is_pooling_checkpoint,
    resolve_pooler_config,
    sentence_transformers_max_seq_length,
)

CLASSIC = "sentence_transformers.models."
TRANSFORMER_V5 = "sentence_transformers.base.modules.transformer.Transformer"
POOLING_V5 = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"
NORMALIZE_V5 = "sentence_transformers.base.modules.normalize.Normalize"


def _write(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def _modules(model_dir: Path, *types: str, pooling: dict[str, Any] | None = None) -> Path:
    """A `modules.json` listing `types` (the Pooling module's config.json from `pooling`)."""
    entries = []
    for i, kind in enumerate(types):
        name = kind.rpartition(".")[2]
        sub = "" if name == "Transformer" else f"{i}_{name}"
        entries.append({"idx": i, "name": str(i), "path": sub, "type": kind})
        if name == "Pooling":
            _write(model_dir / sub / "config.json", pooling or {})
    _write(model_dir / "modules.json", entries)
    return model_dir


def _resolve(model_dir: Path, arch: str = "BertModel", *, convert: str | None = None,
             override: dict[str, Any] | None = None,
             hf: dict[str, Any] | None = None) -> Any:
    return resolve_pooler_config(model_dir, hf or {}, arch, convert=convert, override=override)


def test_all_minilm_layout(tmp_path: Path) -> None:
    """The classic files of the published all-MiniLM-L6-v2: one flag per pooling mode (no
    lasttoken key), and a Normalize module listed whose folder is not shipped."""
    _modules(tmp_path, f"{CLASSIC}Transformer", f"{CLASSIC}Pooling", f"{CLASSIC}Normalize",
             pooling={"word_embedding_dimension": 384, "pooling_mode_cls_token": False,
                      "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
                      "pooling_mode_mean_sqrt_len_tokens": False})
    _write(tmp_path / "sentence_bert_config.json", {"max_seq_length": 256,
                                                    "do_lower_case": False})
    pooler = _resolve(tmp_path)
    assert (pooler.convert, pooler.pooling_type, pooler.normalize, pooler.encoder) == \
        ("embed", "MEAN", True, True)
    assert pooler.id2label == () and pooler.matryoshka_dimensions is None
    assert sentence_transformers_max_seq_length(tmp_path) == 256
    assert is_pooling_checkpoint(tmp_path, "BertModel")


@pytest.mark.parametrize(("mode", "expected"), [("cls", "CLS"), ("mean", "MEAN"),
                                                ("lasttoken", "LAST"), (["cls"], "CLS")])
def test_sentence_transformers_5_layout(tmp_path: Path, mode: Any, expected: str) -> None:
    _modules(tmp_path, TRANSFORMER_V5, POOLING_V5, NORMALIZE_V5,
             pooling={"embedding_dimension": 32, "pooling_mode": mode, "include_prompt": True})
    _write(tmp_path / "2_Normalize" / "config.json",
           {"module_input_name": "sentence_embedding", "module_output_name":
            "sentence_embedding"})
    # sentence-transformers >= 5 keeps max_seq_length out of this file
    _write(tmp_path / "sentence_bert_config.json", {"transformer_task": "feature-extraction"})
    pooler = _resolve(tmp_path, "Qwen3ForCausalLM")
    assert (pooler.pooling_type, pooler.normalize, pooler.encoder) == (expected, True, False)
    assert sentence_transformers_max_seq_length(tmp_path) is None


@pytest.mark.parametrize(("flags", "expected"), [
    ({"pooling_mode_cls_token": True}, "CLS"),
    ({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, "LAST"),
    ({"pooling_mode_cls_token": False}, "MEAN"),  # no flag set: sentence-transformers' mean
])
def test_legacy_pooling_flags(tmp_path: Path, flags: dict[str, bool], expected: str) -> None:
    _modules(tmp_path, f"{CLASSIC}Transformer", f"{CLASSIC}Pooling", pooling=flags)
    pooler = _resolve(tmp_path)
    assert (pooler.pooling_type, pooler.normalize) == (expected, False)  # no Normalize


@pytest.mark.parametrize(("types", "pooling", "message"), [
    ((f"{CLASSIC}Transformer", f"{CLASSIC}Pooling", f"{CLASSIC}Dense"), {},
     "'sentence_transformers.models.Dense' is not supported"),
    ((TRANSFORMER_V5, POOLING_V5, "sentence_transformers.base.modules.dense.Dense"), {},
     "'sentence_transformers.base.modules.dense.Dense' is not supported"),
    ((f"{CLASSIC}Transformer", f"{CLASSIC}WordWeights"), {},
     "'sentence_transformers.models.WordWeights' is not supported"),
    ((f"{CLASSIC}Transformer", f"{CLASSIC}LayerNorm"), {}, "LayerNorm' is not supported"),
    ((TRANSFORMER_V5, POOLING_V5), {"pooling_mode": "max"}, "pooling mode 'max'"),
    ((TRANSFORMER_V5, POOLING_V5), {"pooling_mode": "weightedmean"},
     "pooling mode 'weightedmean'"),
    ((TRANSFORMER_V5, POOLING_V5), {"pooling_mode": ["cls", "mean"]},
     "concatenation of pooling modes"),
    ((f"{CLASSIC}Transformer", f"{CLASSIC}Pooling"),
     {"pooling_mode_mean_sqrt_len_tokens": True}, "'mean_sqrt_len_tokens' is not supported"),
    ((f"{CLASSIC}Transformer", f"{CLASSIC}Pooling"),
     {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True},
     "concatenation of pooling modes"),
])
def test_modules_that_change_the_output_are_refused(
        tmp_path: Path, types: tuple[str, ...], pooling: dict[str, Any], message: str) -> None:
    _modules(tmp_path, *types, pooling=pooling)
    with pytest.raises(ModelDirectoryError, match=message):
        _resolve(tmp_path)
    # a classifier runs its own head; sentence-transformers' modules are not read
    assert _resolve(tmp_path, "BertForSequenceClassification").pooling_type == "CLS"


def test_a_normalize_over_token_embeddings_is_refused(tmp_path: Path) -> None:
    _modules(tmp_path, TRANSFORMER_V5, NORMALIZE_V5)
    _write(tmp_path / "1_Normalize" / "config.json",
           {"module_input_name": "token_embeddings"})
    with pytest.raises(ModelDirectoryError, match="Normalize module over 'token_embeddings'"):
        _resolve(tmp_path)


def test_unreadable_files_name_the_path(tmp_path: Path) -> None:
    (tmp_path / "modules.json").write_text("{not json")
    with pytest.raises(ModelDirectoryError, match=r"modules\.json: unreadable"):
        _resolve(tmp_path)
    _write(tmp_path / "modules.json", [{"idx": 1, "path": "1_Pooling", "type": POOLING_V5}])
    with pytest.raises(ModelDirectoryError, match=r"1_Pooling/config.json: missing"):
        _resolve(tmp_path)
    _write(tmp_path / "sentence_bert_config.json", {"max_seq_length": "long"})
    with pytest.raises(ModelDirectoryError, match="max_seq_length: got 'long'"):
        sentence_transformers_max_seq_length(tmp_path)


@pytest.mark.parametrize(("arch", "convert", "expected"), [
    ("BertModel", None, ("embed", "CLS", True, True)),
    ("XLMRobertaModel", "embed", ("embed", "CLS", True, True)),
    ("BertForSequenceClassification", None, ("classify", "CLS", False, True)),
    ("XLMRobertaForSequenceClassification", "embed", ("embed", "CLS", True, True)),
    ("Qwen2ForCausalLM", "embed", ("embed", "LAST", True, False)),
    ("Qwen2ForSequenceClassification", None, ("classify", "LAST", False, False)),
])
def test_defaults_without_modules_json(tmp_path: Path, arch: str, convert: str | None,
                                       expected: tuple[Any, ...]) -> None:
    pooler = _resolve(tmp_path, arch, convert=convert)
    assert (pooler.convert, pooler.pooling_type, pooler.normalize, pooler.encoder) == expected
    assert is_pooling_checkpoint(tmp_path, arch) == (
        arch in ENCODER_ARCHITECTURES or arch.endswith("ForSequenceClassification"))


def test_convert_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="convert: got 'reward', allowed: embed, classify"):
        _resolve(tmp_path, convert="reward")
    with pytest.raises(ValueError, match="classify needs a classification head; "
                                         "XLMRobertaModel has none"):
        _resolve(tmp_path, "XLMRobertaModel", convert="classify")


def test_labels_in_index_order(tmp_path: Path) -> None:
    names = {str(i): f"label{i}" for i in (10, 2, 0, 1, 3, 4, 5, 6, 7, 8, 9)}
    pooler = _resolve(tmp_path, "BertForSequenceClassification", hf={"id2label": names})
    assert pooler.id2label == tuple(f"label{i}" for i in range(11))
    assert classifier_labels({"num_labels": 1}) == ("LABEL_0",)
    assert classifier_labels({}) == ("LABEL_0", "LABEL_1")  # transformers' default
    assert _resolve(tmp_path, "BertModel", hf={"id2label": names}).id2label == ()  # embed
    with pytest.raises(ModelDirectoryError, match="id2label"):
        classifier_labels({"id2label": {"0": "a", "2": "b"}})


def test_matryoshka_dimensions(tmp_path: Path) -> None:
    assert _resolve(tmp_path, hf={"matryoshka_dimensions": [768, 512, 64]}) \
        .matryoshka_dimensions == (768, 512, 64)
    assert _resolve(tmp_path, hf={"is_matryoshka": True}).matryoshka_dimensions == ()
    assert _resolve(tmp_path, hf={"is_matryoshka": False}).matryoshka_dimensions is None
    with pytest.raises(ModelDirectoryError, match="matryoshka_dimensions"):
        _resolve(tmp_path, hf={"matryoshka_dimensions": [64, 0]})


def test_pooler_config_override(tmp_path: Path) -> None:
    _modules(tmp_path, f"{CLASSIC}Transformer", f"{CLASSIC}Pooling", f"{CLASSIC}Normalize",
             pooling={"pooling_mode_cls_token": True})
    pooler = _resolve(tmp_path, override={"pooling_type": "mean", "normalize": False,
                                          "enable_chunked_processing": True,
                                          "max_embed_len": 10000})
    assert (pooler.pooling_type, pooler.normalize, pooler.enable_chunked_processing,
            pooler.max_embed_len) == ("MEAN", False, True, 10000)
    assert _resolve(tmp_path, override={"pooling_type": None, "normalize": None}) \
        .pooling_type == "CLS"  # null: the model's own


@pytest.mark.parametrize(("override", "message"), [
    ({"dimensions": 8}, "--pooler-config: pooler_config.dimensions: unknown key (allowed: "
                        "pooling_type, normalize, enable_chunked_processing, max_embed_len)"),
    ({"pooling_type": "max"}, "pooler_config.pooling_type: got 'max', allowed: CLS, MEAN, "
                              "LAST"),
    ({"pooling_type": 1}, "pooler_config.pooling_type: got 1"),
    ({"normalize": "yes"}, "pooler_config.normalize: got 'yes', allowed: true, false"),
    ({"enable_chunked_processing": 1}, "pooler_config.enable_chunked_processing: got 1"),
    ({"max_embed_len": 0}, "pooler_config.max_embed_len: got 0, allowed: an integer >= 1"),
    ({"max_embed_len": True}, "pooler_config.max_embed_len: got True"),
    ({"enable_chunked_processing": True}, "pooler_config.enable_chunked_processing: allowed "
                                          "only for embeddings with MEAN pooling"),
])
def test_bad_overrides_name_the_key(tmp_path: Path, override: dict[str, Any],
                                    message: str) -> None:
    with pytest.raises(ValueError, match=_literal(message)):
        _resolve(tmp_path, override=override)  # BertModel: CLS by default


def _literal(text: str) -> str:
    import re

    return re.escape(text)


def test_layout_imports_no_torch() -> None:
    code = ("import sys, ringserve.gpu.pooling.layout\n"
            "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == ""
