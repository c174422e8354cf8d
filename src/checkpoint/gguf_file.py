"""GGUF checkpoints (`ringserve serve path/to/model.gguf`): one llama.cpp file as a model.

A GGUF file holds the hyperparameters, the tokenizer and the (often quantized) weights of a
model in one file. ringserve runs it as an ordinary Hugging Face model directory:
`ModelConfig.from_model_dir` sees `is_gguf`, calls `materialize` to write config.json,
generation_config.json and the tokenizer files into a cache directory (keyed by the caller on
the file's path, size and mtime) and reads that directory; the worker's loader streams the
weights from `iterate_gguf_weights`, dequantized to float32 tensor by tensor. The header parser
lives in `gguf_header`, metadata mapping in `gguf_config`, tensors in `gguf_weights`; the tokenizer is built by transformers'
GGUF support from the file's `tokenizer.ggml.*` metadata (it reads the file only, no hub).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ringserve.checkpoint import gguf_config, gguf_weights
from ringserve.checkpoint.gguf_header import MAGIC, GGUFHeader, read_header
from ringserve.errors import ModelDirectoryError

# Keys that transformers' loader leaves in a saved tokenizer_config.json: load-time options,
# not properties of the tokenizer.
_LOAD_OPTIONS = ("is_local", "local_files_only")


def is_gguf(path: Path) -> bool:
    """True when `path` is a file whose first 4 bytes are the GGUF magic."""
    try:
        with Path(path).open("rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def _config_of(path: Path, header: GGUFHeader) -> dict[str, Any]:
    meta = header.metadata
    arch = gguf_config.architecture(path, meta)
    layers = meta.get(f"{arch}.block_count")
    if not isinstance(layers, int):
        raise ModelDirectoryError(f"GGUF file {path}: metadata {arch}.block_count is missing")
    gguf_weights.check_tensors(path, header.tensors, arch, layers)
    tensors = {t.name: t for t in header.tensors}
    vocab_rows = tensors["token_embd.weight"].shape[0]
    config = gguf_config.hf_config(path, meta, set(tensors), vocab_rows)
    if gguf_weights.ROPE_FREQS in tensors:
        with path.open("rb") as handle:
            factors = gguf_weights.read_tensor(path, handle, tensors[gguf_weights.ROPE_FREQS])
        llama3 = gguf_config.llama3_rope(
            path, factors.numpy(), float(config["rope_theta"]), int(config["head_dim"])
        )
        if llama3 is not None:
            config["rope_scaling"] = llama3
    return config


def gguf_hf_config(path: Path) -> dict[str, Any]:
    """The config.json equivalent of a GGUF file's metadata.

    Also checks the tensors from the header (names, quantization types, extents), so a file the
    worker could not load fails here, in the frontend.

    Raises:
        ModelDirectoryError: not a GGUF file, truncated, an unsupported architecture or
            quantization type, or a missing tensor or key.
    """
    path = Path(path)
    return _config_of(path, read_header(path))


def materialize(path: Path, out_dir: Path, *, with_tokenizer: bool = True) -> None:
    """Write `out_dir` as a Hugging Face model directory (without weights) for GGUF `path`.

    Writes config.json, generation_config.json and, with `with_tokenizer`, tokenizer.json and
    tokenizer_config.json (carrying the file's chat template). The directory is built in a
    temporary sibling and renamed into place, so a concurrent reader never sees half of it;
    when another process got there first with the same files, its directory is kept.

    Raises:
        ModelDirectoryError: as `gguf_hf_config`, or a tokenizer transformers cannot build.
    """
    path, out_dir = Path(path), Path(out_dir)
    header = read_header(path)
    config = _config_of(path, header)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        generation = gguf_config.generation_ids(header.metadata)
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if with_tokenizer:
            _write_tokenizer(path, header.metadata, tmp, vocab_rows=int(config["vocab_size"]))
        _install(tmp, out_dir, with_tokenizer)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _install(tmp: Path, out_dir: Path, with_tokenizer: bool) -> None:
    needed = ["config.json", "generation_config.json"] + (["tokenizer.json"] if with_tokenizer else [])
    if out_dir.exists() and not all((out_dir / name).is_file() for name in needed):
        # A stale or partial directory (an older build, or one written without the tokenizer):
        # move it aside in one rename, then put the new one in its place.
        stale = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-stale-", dir=out_dir.parent))
        out_dir.rename(stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(out_dir)
    except OSError:
        if not all((out_dir / name).is_file() for name in needed):
            raise


def _write_tokenizer(path: Path, meta: dict[str, Any], out: Path, *, vocab_rows: int) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except (ValueError, KeyError, OSError, TypeError) as exc:
        raise ModelDirectoryError(
            f"GGUF file {path}: transformers cannot build its tokenizer "
            f"(tokenizer.ggml.model {meta.get('tokenizer.ggml.model')!r}): {exc}"
        ) from exc
    tokenizer.save_pretrained(str(out))
    _drop_tokens_past_vocab(out / "tokenizer.json", vocab_rows)
    config_file = out / "tokenizer_config.json"
    tok_config: dict[str, Any] = json.loads(config_file.read_text())
    for key in _LOAD_OPTIONS:
        tok_config.pop(key, None)
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        tok_config["chat_template"] = template
        # One source for the template: tokenizer_config.json, not also chat_template.jinja.
        (out / "chat_template.jinja").unlink(missing_ok=True)
    context = meta.get(f"{gguf_config.architecture(path, meta)}.context_length")
    if isinstance(context, int):
        tok_config["model_max_length"] = context
    config_file.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


def _drop_tokens_past_vocab(tokenizer_json: Path, vocab_rows: int) -> None:
    """Remove added tokens the model has no embedding row for.

    transformers' byte-level builder adds GPT-2's default `<|endoftext|>` when the vocabulary
    lacks it (Llama 3's does); its id lies past the embedding, so text containing it would
    index out of range in the model.
    """
    data = json.loads(tokenizer_json.read_text())
    added = data.get("added_tokens") or []
    kept = [entry for entry in added if int(entry["id"]) < vocab_rows]
    if len(kept) != len(added):
        data["added_tokens"] = kept
        tokenizer_json.write_text(json.dumps(data, ensure_ascii=False))


def iterate_gguf_weights(path: Path, hf_config: dict[str, Any], *, deferred: bool = False
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, float32 tensor) for every weight of GGUF `path`, one at a time.

    Names are those of the Hugging Face checkpoint (`model.layers.N.self_attn.q_proj.weight`,
    `model.embed_tokens.weight`, `lm_head.weight` unless tied, ...); llama.cpp's q/k row order
    is undone for the "llama" architecture.

    Args:
        path: the GGUF file.
        hf_config: its config (as `gguf_hf_config` returned it, or read back from config.json).
        deferred: yield the 2-D tensors whose codes a quantized layer keeps without their
            floats (`gguf_codes.is_deferred`; the layers make the floats only where they
            need them), so a quantized model loads without its float copy.

    Raises:
        ModelDirectoryError: as `gguf_hf_config`.
    """
    path = Path(path)
    header = read_header(path)
    arch = gguf_config.architecture(path, header.metadata)
    gguf_weights.check_tensors(path, header.tensors, arch, int(hf_config["num_hidden_layers"]))
    yield from gguf_weights.iterate_weights(
        path, header.tensors, hf_config, permuted=arch == "llama", deferred=deferred
    )
