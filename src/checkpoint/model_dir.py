"""Reading a model directory for `ringserve.config.ModelConfig.from_model_dir`: the checks on
its files (config.json, weights, tokenizer), the GGUF file's materialized directory, the raw
config (a multimodal checkpoint's `text_config` merged in), its architecture, the longest
sequence it allows, the end-of-generation ids and the generation-config directory (the
compute dtype and weight format: `ringserve.checkpoint.precision`). Each problem is a
`ModelDirectoryError` (or `ValueError` for a bad option) naming the file and what is wrong.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ringserve.checkpoint.generation_config import read_generation_config
from ringserve.checkpoint.gguf_file import is_gguf, materialize
from ringserve.checkpoint.gguf_header import read_header
from ringserve.checkpoint.precision import GGUFTensor
from ringserve.checkpoint.safetensors_file import check_headers, checkpoint_files
from ringserve.checkpoint.support import QUANTIZATION_CHOICES, SUPPORTED_ARCHITECTURES
from ringserve.envs import ringserve_home
from ringserve.errors import ModelDirectoryError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: Path, load_format: str) -> None:
    """The model directory exists, has config.json and (for safetensors) whole weight files."""
    if not path.is_dir():
        raise ModelDirectoryError(
            f"model directory {path} is not a directory (ringserve loads Hugging Face model "
            "directories, GGUF files and hub ids; `ringserve demo-model PATH` writes a small "
            "model)"
        )
    if not (path / "config.json").is_file():
        raise ModelDirectoryError(f"model directory {path}: config.json is missing")
    if load_format == "safetensors":
        check_headers(checkpoint_files(path))


def check_quantization(quantization: str | None, device: str, *,
                       gguf_dequantize: bool = False) -> None:
    """Refuse a quantization method ringserve does not run, one on a device it lacks, or one
    with `--gguf-dequantize` (which asks for float weights)."""
    if quantization is not None and quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization: got {quantization!r}, allowed: None (float weights, "
                         f"or a quantized GGUF file's codes), "
                         f"{', '.join(QUANTIZATION_CHOICES)}")
    if quantization is not None and gguf_dequantize:
        raise ValueError(f"gguf_dequantize: asks for float weights, and quantization "
                         f"{quantization} for {quantization} panels; give one of them")
    if quantization is not None and device != "cpu":
        # The packed kernels are torch's CPU weight-only matmuls; CUDA has its own layouts.
        raise ValueError(f"quantization: {quantization} runs on CPU only (device is {device})")


def gguf_model_dir(path: Path, tokenizer: str | None) -> Path:
    """A Hugging Face-style directory (config, generation config, tokenizer) written from a
    GGUF file's metadata, cached under RINGSERVE_HOME by the file's path, size and mtime."""
    if not is_gguf(path):
        raise ModelDirectoryError(f"{path}: not a GGUF file (load_format gguf)")
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|"
                         f"{tokenizer is None}".encode()).hexdigest()[:16]
    target = ringserve_home() / "gguf" / f"{path.stem}-{key}"
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        materialize(path, target, with_tokenizer=tokenizer is None)
    return target


def gguf_tensors(path: Path) -> list[GGUFTensor]:
    """The names, types and ranks of a GGUF file's tensors (from its header)."""
    return [GGUFTensor(t.name, t.type_name, len(t.shape)) for t in read_header(path).tensors]


def check_tokenizer_dir(path: Path) -> None:
    """The tokenizer directory exists and holds a tokenizer file."""
    if not path.is_dir():
        raise ModelDirectoryError(f"tokenizer directory {path} does not exist")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirectoryError(
            f"tokenizer directory {path}: no tokenizer file ({', '.join(TOKENIZER_FILES)})"
        )


def load_hf_config(path: Path) -> dict[str, Any]:
    """config.json through transformers' AutoConfig, as a dict (a multimodal checkpoint's
    text_config merged in), with the shape keys checked."""
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelDirectoryError(f"model directory {path}: config.json unreadable: {exc}") from exc
    data: dict[str, Any] = hf.to_dict()
    text_config = data.get("text_config")
    if isinstance(text_config, dict):
        # A multimodal checkpoint served as text: the language model's settings, under the
        # checkpoint's own architecture (its text_config may name the text-only class).
        data = {**data, **text_config, "architectures": data.get("architectures")}
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if not isinstance(data.get(key), int):
            raise ModelDirectoryError(f"model directory {path}: config.json has no integer {key!r}")
    return data


def architecture(path: Path, hf: dict[str, Any]) -> str:
    """The first architecture of config.json that ringserve runs."""
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    raise ModelDirectoryError(
        f"model directory {path}: architecture {archs or 'missing'} in config.json is not "
        f"supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def derived_max_len(hf: dict[str, Any]) -> int:
    """The longest sequence the config allows: max_position_embeddings, stretched as vLLM
    does by a rope scaling that extends the context (yarn: its original context times the
    factor; linear and dynamic: times the factor). llama3 and longrope configs already count
    the scaling in max_position_embeddings, and so do Gemma 3's (whose rope parameters come
    per layer type)."""
    derived = 2048
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = hf.get(key)
        if isinstance(value, int) and value > 0:
            derived = value
            break
    rope = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not isinstance(rope, dict) or str(hf.get("model_type", "")).startswith("gemma3"):
        return derived
    rope_type = rope.get("rope_type") or rope.get("type")
    factor = rope.get("factor")
    if rope_type in ("yarn", "linear", "dynamic") and isinstance(factor, (int, float)):
        if rope_type == "yarn" and isinstance(rope.get("original_max_position_embeddings"), int):
            derived = int(rope["original_max_position_embeddings"])
        return max(derived, int(derived * float(factor)))
    return derived


def eos_token_ids(path: Path, hf: dict[str, Any], gen_dir: Path | None) -> tuple[int, ...]:
    """The ids that end generation: the generation config's (the model's own, plus those of
    `--generation-config DIR`), else config.json's `eos_token_id`."""
    ids: list[int] = []
    for directory in dict.fromkeys(d for d in (path, gen_dir) if d is not None):
        raw = read_generation_config(directory).get("eos_token_id")
        for i in raw if isinstance(raw, list) else [raw]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    if not ids:
        raw = hf.get("eos_token_id")
        ids = [int(i) for i in (raw if isinstance(raw, list) else [raw]) if isinstance(i, int)]
    return tuple(ids)


def generation_config_dir(choice: str, model_dir: Path) -> Path | None:
    """Where the generation config is read: the model's directory (auto), none (vllm), or DIR."""
    if choice == "vllm":
        return None
    if choice == "auto":
        return model_dir
    path = Path(choice)
    if not (path / "generation_config.json").is_file():
        raise ModelDirectoryError(f"--generation-config {choice}: no generation_config.json "
                                  "there (allowed: auto, vllm, or a directory holding one)")
    return path
