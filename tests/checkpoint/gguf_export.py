"""Test-side GGUF writer: a Hugging Face model directory -> a GGUF file, as llama.cpp writes one.

Written from llama.cpp's documented layout (gguf-py's `GGUFWriter`, its key names and its
HF-name -> GGUF-name table `TensorNameMap`), independently of `ringserve.checkpoint`, so the
tests read back with ringserve's reader what a different writer produced:

- architecture metadata under `{arch}.*` (llama / mistral -> "llama", qwen2, qwen3), rope
  scaling as `rope.scaling.*` keys (linear, yarn) or, for llama3 rope, the `rope_freqs` tensor
  of per-frequency divisors that convert_hf_to_gguf.py writes instead of keys;
- the tokenizer as llama.cpp stores a byte-level BPE ("gpt2" model): tokens padded to the
  vocabulary size with `[PAD{i}]`, token types (control for special added tokens), merges,
  special ids, add_bos_token and the chat template;
- tensors under llama.cpp names, q/k rows permuted for the "llama" architecture, 2-D weights
  quantized with `gguf.quants.quantize` (1-D norms and biases stay F32, as llama.cpp keeps them).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open

_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_MODEL_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
               "qwen3": gguf.MODEL_ARCH.QWEN3}


def export_gguf(
    model_dir: Path,
    out: Path,
    *,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    name: str = "tiny",
    drop: frozenset[str] = frozenset(),
    replace: dict[str, np.ndarray] | None = None,
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """Write `model_dir` as the GGUF file `out` with 2-D weights stored as `qtype`.

    `types` stores some 2-D weights as another type (a mixed file, as llama-quantize's
    Q4_K_M writes one); `drop` leaves out tensors and `replace` writes arrays as they are in
    place of tensors (all three by GGUF name), to make broken files.
    """
    config = json.loads((model_dir / "config.json").read_text())
    arch = _ARCHS[config["model_type"]]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name)
    _add_hparams(writer, config)
    _add_tokenizer(writer, model_dir, int(config["vocab_size"]))
    _add_tensors(writer, model_dir, config, arch, qtype, drop, replace or {}, types or {})
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    return dict(config.get("rope_parameters") or config.get("rope_scaling") or {})


def _head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _add_hparams(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    head_dim = _head_dim(config)
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_head_count_kv(int(config["num_key_value_heads"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = _rope(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    rope_type = rope.get("rope_type", "default")
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def _add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    by_id = {index: token for token, index in tok["model"]["vocab"].items()}
    added = {entry["id"]: entry for entry in tok.get("added_tokens", [])}
    by_id.update({index: entry["content"] for index, entry in added.items()})
    tokens: list[str] = []
    types: list[int] = []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(by_id[index])
            special = added[index].get("special", False)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    ids = {token: index for index, token in by_id.items()}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(ids[tok_config["bos_token"]])
    writer.add_eos_token_id(ids[tok_config["eos_token"]])
    writer.add_pad_token_id(ids[tok_config["pad_token"]])
    writer.add_add_bos_token(True)  # the tokenizer's post-processor prepends BOS
    template = tok_config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template is not None:
        writer.add_chat_template(template)


def llama_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's q/k row order: each head's rotate-half pairs interleaved."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _add_tensors(
    writer: gguf.GGUFWriter,
    model_dir: Path,
    config: dict[str, Any],
    arch: str,
    qtype: gguf.GGMLQuantizationType,
    drop: frozenset[str],
    replace: dict[str, np.ndarray],
    types: dict[str, gguf.GGMLQuantizationType],
) -> None:
    names = gguf.get_tensor_name_map(_MODEL_ARCH[arch], int(config["num_hidden_layers"]))
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for hf_name in sorted(f.keys()):
            tensor = f.get_tensor(hf_name).to(torch.float32)
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, hf_name
            if gguf_name in drop:
                continue
            if gguf_name in replace:
                writer.add_tensor(gguf_name, replace[gguf_name])
                continue
            if arch == "llama" and ".q_proj." in hf_name:
                tensor = llama_permute(tensor, int(config["num_attention_heads"]))
            elif arch == "llama" and ".k_proj." in hf_name:
                tensor = llama_permute(tensor, int(config["num_key_value_heads"]))
            _add_array(writer, gguf_name, tensor.numpy(), types.get(gguf_name, qtype))
    rope = _rope(config)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config, rope))


def _add_array(
    writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: gguf.GGMLQuantizationType
) -> None:
    if array.ndim < 2 or qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        return
    packed = gguf.quants.quantize(array, qtype)
    writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)


def llama3_rope_factors(config: dict[str, Any], rope: dict[str, Any]) -> np.ndarray:
    """The divisors of each rope frequency, by the formula of convert_hf_to_gguf.py."""
    dim = _head_dim(config)
    base = float(rope["rope_theta"])
    factor = float(rope["factor"])
    low = float(rope["low_freq_factor"])
    high = float(rope["high_freq_factor"])
    old_len = float(rope["original_max_position_embeddings"])
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
