"""A GGUF file's metadata read as Hugging Face configuration: config.json and generation ids.

llama.cpp stores a model's hyperparameters as `{arch}.*` keys and its tokenizer as
`tokenizer.ggml.*` keys (see gguf-py's `Keys`). `hf_config` maps them onto the config.json
fields ringserve's model code reads, for the architectures it runs (llama, qwen2, qwen3;
llama.cpp writes Mistral checkpoints as "llama" and keeps no sign of it, so those load as
Llama, which computes the same thing without a sliding window). Llama 3's rope scaling is not
stored as keys but as the `rope_freqs` tensor of per-frequency divisors; `llama3_rope` recovers
transformers' llama3 parameters from it. `generation_ids` gives the ids that end generation the
way llama.cpp decides its end-of-generation set (eos, eot, eom and the well-known end-of-turn
tokens). Used by `ringserve.checkpoint.gguf_file`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ringserve.errors import ModelDirectoryError

# GGUF architecture -> (HF architecture class, model_type)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# Texts of control tokens that end a turn in the common chat formats; llama.cpp stops on these
# as well as on the eos / eot / eom ids the file names.
END_OF_TURN_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>",
    "<end_of_turn>", "<EOT>",
})

# general.sampling.* key suffix -> generation_config.json key
SAMPLING_KEYS: dict[str, str] = {
    "temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}

_CONTROL = 3  # gguf.TokenType.CONTROL


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that reads back as it (1e-06, not
    9.99999997e-07), as the config.json it was converted from most likely wrote it."""
    return float(str(np.float32(value)))


def field(meta: dict[str, Any], key: str) -> Any:
    """The value of metadata `key` (a scalar, a string, a list or an array), or None."""
    return meta.get(key)


def architecture(path: Path, meta: dict[str, Any]) -> str:
    """The file's `general.architecture`, checked against the supported ones.

    Raises:
        ModelDirectoryError: the architecture is missing or not supported.
    """
    arch = field(meta, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelDirectoryError(
            f"GGUF file {path}: architecture {arch!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)} (Mistral files are written as llama)"
        )
    return str(arch)


def hf_config(path: Path, meta: dict[str, Any], tensor_names: set[str], vocab_rows: int) -> dict[str, Any]:
    """The config.json equivalent of the file's metadata.

    Args:
        path: the file, for messages.
        meta: its metadata (`gguf_header.GGUFHeader.metadata`).
        tensor_names: the names of its tensors (tied embeddings, biases).
        vocab_rows: the rows of `token_embd.weight` (the vocabulary the model has).

    Raises:
        ModelDirectoryError: a required key is missing or has an unusable value.
    """
    arch = architecture(path, meta)
    cls, model_type = ARCHITECTURES[arch]

    def required(key: str) -> int:
        value = field(meta, f"{arch}.{key}")
        if not isinstance(value, int):
            raise ModelDirectoryError(
                f"GGUF file {path}: metadata {arch}.{key} is {value!r}, expected an integer"
            )
        return value

    heads = required("attention.head_count")
    hidden = required("embedding_length")
    head_dim = field(meta, f"{arch}.attention.key_length") or hidden // heads
    rope_dims = field(meta, f"{arch}.rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim:
        raise ModelDirectoryError(
            f"GGUF file {path}: partial rotary embeddings ({arch}.rope.dimension_count "
            f"{rope_dims} of head dim {head_dim}) are not supported"
        )
    theta = _f32(field(meta, f"{arch}.rope.freq_base") or 10000.0)
    config: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": vocab_rows,
        "hidden_size": hidden,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field(meta, f"{arch}.attention.head_count_kv") or heads,
        "head_dim": int(head_dim),
        "rms_norm_eps": _f32(field(meta, f"{arch}.attention.layer_norm_rms_epsilon") or 1e-6),
        "rope_theta": theta,
        "max_position_embeddings": required("context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        "hidden_act": "silu",
        "dtype": "float32",
    }
    if not isinstance(config["num_key_value_heads"], int):
        raise ModelDirectoryError(
            f"GGUF file {path}: per-layer {arch}.attention.head_count_kv is not supported"
        )
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        value = field(meta, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config[key] = int(value)
    scaling = rope_scaling(path, meta, arch)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def rope_scaling(path: Path, meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """transformers' `rope_scaling` for the file's `rope.scaling.*` keys (linear, yarn).

    Raises:
        ModelDirectoryError: a scaling type ringserve has no mapping for.
    """
    kind = field(meta, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = field(meta, f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor is not None:
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn" and factor is not None:
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": _f32(factor)}
        original = field(meta, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for suffix, key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = field(meta, f"{arch}.rope.scaling.{suffix}")
            if value is not None:
                scaling[key] = _f32(value)
        return scaling
    raise ModelDirectoryError(
        f"GGUF file {path}: rope scaling {kind!r} (factor {factor!r}) is not supported; "
        "supported: linear and yarn with a factor, llama3 through rope_freqs"
    )


def llama3_rope(
    path: Path, factors: np.ndarray, theta: float, head_dim: int
) -> dict[str, Any] | None:
    """transformers' llama3 rope parameters that reproduce the `rope_freqs` divisors.

    convert_hf_to_gguf.py divides each frequency by 1 (short wavelengths), by `factor` (long
    ones) or, in between, by 1 / ((1 - s) / factor + s) with s linear in 1 / wavelength. So the
    largest divisor is `factor`, and a straight-line fit of s over the in-between frequencies
    gives the band. Only the ratios original_context / low_freq_factor and
    original_context / high_freq_factor matter to the formula, so original_context is fixed at
    Llama 3's 8192 and the two factors are solved for.

    Returns:
        None when no frequency is scaled.

    Raises:
        ModelDirectoryError: the divisors do not follow the llama3 formula.
    """
    r = factors.astype(np.float64).reshape(-1)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(r.max(initial=1.0))
    if r.shape != inv_freq.shape or float(r.min(initial=1.0)) < 1.0 - 1e-6:
        raise ModelDirectoryError(
            f"GGUF file {path}: rope_freqs has {r.size} divisors down to {r.min(initial=1.0)}; "
            f"expected {inv_freq.size} divisors >= 1 (llama3 rope scaling)"
        )
    if factor <= 1.0 + 1e-6:
        return None
    smooth = (1.0 / r - 1.0 / factor) / (1.0 - 1.0 / factor)
    band = (r > 1.0 + 1e-5) & (r < factor * (1.0 - 1e-5))
    if int(band.sum()) < 2:
        raise ModelDirectoryError(
            f"GGUF file {path}: rope_freqs scales fewer than two frequencies partly; the llama3 "
            "rope parameters cannot be recovered from it"
        )
    inv_wavelen = inv_freq / (2 * math.pi)
    slope, intercept = np.polyfit(inv_wavelen[band], smooth[band], 1)
    original = 8192.0
    low = -intercept * original / slope
    high = low + original / slope
    params = {
        "rope_type": "llama3", "factor": _f32(factor), "low_freq_factor": _f32(low),
        "high_freq_factor": _f32(high), "original_max_position_embeddings": int(original),
    }
    _check_llama3(path, r, inv_freq, params)
    return params


def _check_llama3(path: Path, r: np.ndarray, inv_freq: np.ndarray, params: dict[str, Any]) -> None:
    wavelen = 2 * math.pi / inv_freq
    original = params["original_max_position_embeddings"]
    low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
    s = (original / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < original / high, 1.0,
        np.where(wavelen > original / low, factor, 1.0 / ((1 - s) / factor + s)),
    )
    if not np.allclose(expected, r, rtol=1e-4, atol=0.0):
        raise ModelDirectoryError(
            f"GGUF file {path}: rope_freqs does not follow the llama3 rope formula "
            f"(best fit {params})"
        )


def generation_ids(meta: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json contents: bos, pad, the end-of-generation ids and sampling
    defaults (`general.sampling.*`)."""
    out: dict[str, Any] = {}
    bos = field(meta, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        out["bos_token_id"] = int(bos)
    eos: list[int] = []
    for name in ("eos", "eot", "eom"):
        value = field(meta, f"tokenizer.ggml.{name}_token_id")
        if value is not None and int(value) not in eos:
            eos.append(int(value))
    for index in _end_of_turn_ids(meta):
        if index not in eos:
            eos.append(index)
    if eos:
        out["eos_token_id"] = eos
    pad = field(meta, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        out["pad_token_id"] = int(pad)
    for suffix, key in SAMPLING_KEYS.items():
        value = field(meta, f"general.sampling.{suffix}")
        if value is not None:
            out[key] = value
    return out


def _end_of_turn_ids(meta: dict[str, Any]) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    tokens = meta.get("tokenizer.ggml.tokens")
    if types is None or tokens is None:
        return []
    return [
        int(index) for index in np.flatnonzero(np.asarray(types) == _CONTROL)
        if index < len(tokens) and tokens[index] in END_OF_TURN_TEXTS
    ]
