"""What a pooling checkpoint says about its pooler: the files sentence-transformers reads
(`modules.json`, the Pooling module's `config.json`, `sentence_bert_config.json`) and the
classifier's labels in `config.json`, resolved with `--convert` and `--pooler-config` into
the `PoolerConfig` the engine runs.

Called at the edge (`ringserve.gpu.pooling.engine_config`) in the frontend's process, so this
module imports no torch; the encoder (`ringserve.gpu.pooling.encoder`) takes the list of
encoder architectures and the label count from here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, cast

from ringserve.config import PoolerConfig
from ringserve.errors import ModelDirectoryError

__all__ = ["ENCODER_ARCHITECTURES", "OVERRIDE_KEYS", "POOLING_TYPES", "classifier_labels",
           "is_pooling_checkpoint", "resolve_pooler_config",
           "sentence_transformers_max_seq_length"]

PoolingType = Literal["CLS", "MEAN", "LAST"]

# The bidirectional encoders `ringserve.gpu.pooling.encoder` runs.
ENCODER_ARCHITECTURES: tuple[str, ...] = (
    "BertModel", "BertForSequenceClassification",
    "XLMRobertaModel", "XLMRobertaForSequenceClassification",
)
POOLING_TYPES: tuple[PoolingType, ...] = ("CLS", "MEAN", "LAST")
CONVERTS = ("embed", "classify")
# The `--pooler-config` keys ringserve reads (vLLM's names).
OVERRIDE_KEYS = ("pooling_type", "normalize", "enable_chunked_processing", "max_embed_len")

# sentence-transformers' pooling modes: the older one-flag-per-mode keys, in the order its
# Pooling module reads them, and the single `pooling_mode` of sentence-transformers >= 5.
_LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_MODES: dict[str, PoolingType] = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
# Modules (by class name, whatever the namespace: `sentence_transformers.models.Pooling`,
# `sentence_transformers.sentence_transformer.modules.pooling.Pooling`, ...) that the engine
# reproduces; Dropout does nothing at inference. Anything else would change the output.
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"
_KNOWN_MODULES = (_TRANSFORMER, _POOLING, _NORMALIZE, "Dropout")


def is_pooling_checkpoint(model_dir: Path, architecture: str) -> bool:
    """The checkpoint is served by the pooling runner unless told otherwise (vLLM's rule):
    an encoder, a sequence classifier, or a sentence-transformers layout (`modules.json`)."""
    return (architecture in ENCODER_ARCHITECTURES
            or architecture.endswith("ForSequenceClassification")
            or (model_dir / "modules.json").is_file())


def resolve_pooler_config(model_dir: Path, hf_config: dict[str, Any], architecture: str, *,
                          convert: str | None,
                          override: dict[str, Any] | None) -> PoolerConfig:
    """The pooler of a checkpoint, as sentence-transformers would run it, under the user's
    `--convert` and `--pooler-config`.

    Defaults: `convert` is "classify" for a `*ForSequenceClassification` architecture, else
    "embed". An embedding model pools as its sentence-transformers Pooling module says and
    normalises iff a Normalize module is listed; without `modules.json` an encoder pools its
    CLS token, a decoder its last token, and the embedding is normalised. A classifier pools
    the first token of an encoder (its head reads that token) and the last of a decoder.

    Args:
        model_dir: the checkpoint directory.
        hf_config: its `config.json`.
        architecture: its architecture class name.
        convert: "embed", "classify", or None (the default above).
        override: `--pooler-config` as a dict (keys in `OVERRIDE_KEYS`), or None.

    Raises:
        ValueError: a bad `convert`, or classify for an encoder without a head; an unknown `--pooler-config` key or a bad value (the
            message names `pooler_config.<key>`); chunked processing asked of anything but
            MEAN-pooled embeddings.
        ModelDirectoryError: a sentence-transformers file is unreadable, or lists a module
            or pooling mode ringserve does not run (Dense, LayerNorm, max pooling, ...).
    """
    if convert is None:
        convert = "classify" if architecture.endswith("ForSequenceClassification") else "embed"
    if convert not in CONVERTS:
        raise ValueError(f"convert: got {convert!r}, allowed: {', '.join(CONVERTS)}")
    options = _parse_override(override or {})
    encoder = architecture in ENCODER_ARCHITECTURES
    if convert == "classify" and encoder and not architecture.endswith(
            "ForSequenceClassification"):
        raise ValueError(f"convert: classify needs a classification head; {architecture} "
                         "has none (allowed: embed)")
    if convert == "embed":
        st_pooling, st_normalize = _sentence_transformers_pooler(model_dir)
        pooling_type = st_pooling or ("CLS" if encoder else "LAST")
        normalize = True if st_normalize is None else st_normalize
    else:
        pooling_type, normalize = ("CLS" if encoder else "LAST"), False
    pooling_type = cast(PoolingType, options.get("pooling_type", pooling_type))
    chunked = bool(options.get("enable_chunked_processing", False))
    if chunked and (convert != "embed" or pooling_type != "MEAN"):
        raise ValueError(
            "--pooler-config: pooler_config.enable_chunked_processing: allowed only for "
            f"embeddings with MEAN pooling (this model: {convert} with {pooling_type} "
            "pooling); chunks pool into their token-weighted mean")
    return PoolerConfig(
        convert=cast(Literal["embed", "classify"], convert),
        pooling_type=pooling_type,
        normalize=bool(options.get("normalize", normalize)),
        encoder=encoder,
        enable_chunked_processing=chunked,
        max_embed_len=options.get("max_embed_len"),
        matryoshka_dimensions=_matryoshka_dimensions(hf_config),
        id2label=classifier_labels(hf_config) if convert == "classify" else (),
    )


def sentence_transformers_max_seq_length(model_dir: Path) -> int | None:
    """`max_seq_length` from `sentence_bert_config.json` (None: no file or no such key, as
    sentence-transformers >= 5 writes it).

    Raises:
        ModelDirectoryError: the file is not JSON, or the value is not an integer >= 1.
    """
    path = model_dir / "sentence_bert_config.json"
    if not path.is_file():
        return None
    value = _read_json(path).get("max_seq_length")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelDirectoryError(f"{path}: max_seq_length: got {value!r}, expected an "
                                  "integer >= 1")
    return value


def classifier_labels(hf_config: dict[str, Any]) -> tuple[str, ...]:
    """The classifier's label names in label order: `id2label` (ordered by its integer keys),
    else `LABEL_0`... for `num_labels` (transformers' default, 2).

    Raises:
        ModelDirectoryError: `id2label` is not an object of integer keys 0..n-1.
    """
    id2label = hf_config.get("id2label")
    if not id2label:
        count = int(hf_config.get("num_labels") or 2)
        return tuple(f"LABEL_{i}" for i in range(count))
    if not isinstance(id2label, dict):
        raise ModelDirectoryError(f"config.json: id2label: got {id2label!r}, expected an "
                                  "object of label index -> name")
    try:
        ordered = sorted((int(k), str(v)) for k, v in id2label.items())
    except ValueError:
        raise ModelDirectoryError(f"config.json: id2label: keys {sorted(id2label)} are not "
                                  "integers") from None
    if [i for i, _ in ordered] != list(range(len(ordered))):
        raise ModelDirectoryError(f"config.json: id2label: keys {[i for i, _ in ordered]} are "
                                  f"not 0..{len(ordered) - 1}")
    return tuple(name for _, name in ordered)


def _parse_override(override: dict[str, Any]) -> dict[str, Any]:
    """`--pooler-config` checked, values normalised; keys given as null are left out."""
    out: dict[str, Any] = {}
    for key, value in override.items():
        if key not in OVERRIDE_KEYS:
            raise ValueError(f"--pooler-config: pooler_config.{key}: unknown key (allowed: "
                             f"{', '.join(OVERRIDE_KEYS)})")
        if value is None:
            continue
        where = f"--pooler-config: pooler_config.{key}: got {value!r}"
        if key == "pooling_type":
            upper = value.upper() if isinstance(value, str) else None
            if upper not in POOLING_TYPES:
                raise ValueError(f"{where}, allowed: {', '.join(POOLING_TYPES)}")
            out[key] = upper
        elif key in ("normalize", "enable_chunked_processing"):
            if not isinstance(value, bool):
                raise ValueError(f"{where}, allowed: true, false")
            out[key] = value
        else:  # max_embed_len
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}, allowed: an integer >= 1")
            out[key] = value
    return out


def _sentence_transformers_pooler(model_dir: Path) -> tuple[PoolingType | None, bool | None]:
    """The pooling type and normalisation a `modules.json` describes ((None, None): no
    `modules.json`; a None pooling type: no Pooling module)."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return None, None
    modules = _read_json(path, expect=list)
    pooling: PoolingType | None = None
    normalize = False
    for entry in modules:
        if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
            raise ModelDirectoryError(f"{path}: each module must be an object with a 'type'; "
                                      f"got {entry!r}")
        kind = entry["type"].rpartition(".")[2]
        sub = model_dir / str(entry.get("path") or "")
        if kind not in _KNOWN_MODULES:
            raise ModelDirectoryError(
                f"{path}: module {entry['type']!r} is not supported (ringserve runs "
                f"{', '.join(_KNOWN_MODULES)}); its output would differ from "
                "sentence-transformers'")
        if kind == _POOLING:
            if pooling is not None:
                raise ModelDirectoryError(f"{path}: more than one Pooling module is not "
                                          "supported")
            pooling = _pooling_mode(sub / "config.json")
        elif kind == _NORMALIZE:
            _check_normalize(sub / "config.json")
            normalize = True
    return pooling, normalize


def _pooling_mode(path: Path) -> PoolingType:
    """The Pooling module's mode, from either form of its `config.json`."""
    config = _read_json(path)
    mode = config.get("pooling_mode")
    if mode is None:
        # sentence-transformers' own rule for the older form: the flags set, mean if none.
        active = [m for key, m in _LEGACY_MODE_KEYS.items() if config.get(key)]
        mode = active or ["mean"]
    modes = [mode] if isinstance(mode, str) else mode
    if not isinstance(modes, list) or len(modes) != 1 or not isinstance(modes[0], str):
        raise ModelDirectoryError(
            f"{path}: pooling mode {mode!r} is not supported (a concatenation of pooling "
            f"modes; ringserve runs one of {', '.join(_MODES)})")
    if modes[0] not in _MODES:
        raise ModelDirectoryError(f"{path}: pooling mode {modes[0]!r} is not supported "
                                  f"(ringserve runs {', '.join(_MODES)})")
    return _MODES[modes[0]]


def _check_normalize(path: Path) -> None:
    """A Normalize module normalises the sentence embedding (its default; sentence-
    transformers >= 5 may point one at the token embeddings instead, which ringserve does not
    run). Older ones have no config file at all."""
    if not path.is_file():
        return
    target = _read_json(path).get("module_input_name", "sentence_embedding")
    if target != "sentence_embedding":
        raise ModelDirectoryError(f"{path}: a Normalize module over {target!r} is not "
                                  "supported (ringserve normalises the sentence embedding)")


def _read_json(path: Path, expect: type = dict) -> Any:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelDirectoryError(f"{path}: missing (sentence-transformers needs it)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelDirectoryError(f"{path}: unreadable: {exc}") from None
    if not isinstance(value, expect):
        raise ModelDirectoryError(f"{path}: expected a JSON {expect.__name__}, got "
                                  f"{type(value).__name__}")
    return value


def _matryoshka_dimensions(hf_config: dict[str, Any]) -> tuple[int, ...] | None:
    """The Matryoshka dimensions a request may ask for: `matryoshka_dimensions`, or any
    (an empty tuple) when only `is_matryoshka` is set; None for other models.

    Raises:
        ModelDirectoryError: `matryoshka_dimensions` is not a list of integers >= 1.
    """
    dims = hf_config.get("matryoshka_dimensions")
    if dims is not None:
        if not isinstance(dims, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims):
            raise ModelDirectoryError(f"config.json: matryoshka_dimensions: got {dims!r}, "
                                      "expected a list of integers >= 1")
        return tuple(dims)
    return () if hf_config.get("is_matryoshka") is True else None
