"""A GGUF file's tensors under their Hugging Face names, dequantized to float32 one at a time.

llama.cpp names tensors `token_embd`, `blk.N.attn_q`, ... and, for the "llama" architecture,
stores q and k with each head's rows reordered (convert_hf_to_gguf.py interleaves the two
rotate-half halves, as ggml's rope wants); `iterate_weights` maps the names back, undoes that
order and dequantizes with gguf-py's reference code (`gguf.quants.dequantize`). Each tensor's
bytes are read with `readinto` into a buffer of their own rather than through a memory map of
the file, so mapped pages do not pile up in the worker's resident memory (as
`ringserve.checkpoint.safetensors_file` explains): peak memory is the model plus one tensor's
bytes and its float32 copy. A quantized model's loader asks for the tensors whose codes its
layers keep deferred (`read_tensor(deferred=True)`): nothing is read until a layer packs them,
so neither their floats nor the file's bytes pile up. `check_tensors` validates names, types and extents from the
header alone, so a bad file fails in the frontend. Used by `ringserve.checkpoint.gguf_file`.
"""

from __future__ import annotations

import functools
import io
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ringserve.checkpoint import gguf_codes
from ringserve.checkpoint.gguf_header import TensorInfo
from ringserve.errors import ModelDirectoryError

GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_REQUIRED = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                   "ffn_gate", "ffn_up", "ffn_down")
_EXTRA_REQUIRED: dict[str, tuple[str, ...]] = {
    "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qwen3": ("attn_q_norm", "attn_k_norm"),
}
# Read into the config (llama3 rope scaling), not a model parameter.
ROPE_FREQS = "rope_freqs.weight"
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str) -> str | None:
    """The Hugging Face name of GGUF tensor `name`, or None when it has none."""
    base, _, kind = name.rpartition(".")
    if base in GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{GLOBAL_NAMES[base]}.{kind}"
    match = _LAYER_RE.fullmatch(name)
    if match is None or match[2] not in LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{LAYER_NAMES[match[2]]}.{match[3]}"


@functools.cache
def supported_types() -> tuple[str, ...]:
    """The tensor types gguf-py can dequantize (probed once on one zero block each)."""
    import gguf

    names = []
    for qtype, (_, type_size) in gguf.GGML_QUANT_SIZES.items():
        try:
            gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError, TypeError):
            continue
        names.append(qtype.name)
    return tuple(names)


def check_tensors(path: Path, tensors: tuple[TensorInfo, ...], arch: str, num_layers: int) -> None:
    """Check every tensor has a Hugging Face name, a supported type and lies inside the file,
    and that the tensors the architecture needs are all there.

    Raises:
        ModelDirectoryError: the first problem found, naming the tensor.
    """
    size = path.stat().st_size
    for tensor in tensors:
        if tensor.name != ROPE_FREQS and hf_name(tensor.name) is None:
            raise ModelDirectoryError(
                f"GGUF file {path}: tensor {tensor.name!r} has no counterpart in the {arch} model"
            )
        if tensor.n_bytes is None or tensor.type_name not in supported_types():
            raise ModelDirectoryError(
                f"GGUF file {path}: tensor {tensor.name!r} has quantization type "
                f"{tensor.type_name}, not supported; supported: {', '.join(supported_types())}"
            )
        if tensor.offset + tensor.n_bytes > size:
            raise ModelDirectoryError(
                f"GGUF file {path} is truncated: tensor {tensor.name!r} ends at byte "
                f"{tensor.offset + tensor.n_bytes}, the file has {size}"
            )
    names = {tensor.name for tensor in tensors}
    required = ["token_embd.weight", "output_norm.weight"]
    per_layer = [*_LAYER_REQUIRED, *_EXTRA_REQUIRED.get(arch, ())]
    for layer in range(num_layers):
        required += [f"blk.{layer}.{n}" if "." in n else f"blk.{layer}.{n}.weight" for n in per_layer]
    missing = [name for name in required if name not in names]
    if missing:
        raise ModelDirectoryError(
            f"GGUF file {path}: missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )


def read_tensor(path: Path, handle: io.BufferedReader, tensor: TensorInfo, *,
                deferred: bool = False) -> torch.Tensor:
    """One tensor of an open GGUF file as float32, in Hugging Face (row-major) shape.

    Args:
        path: the file (for messages).
        handle: the file, open.
        tensor: which tensor.
        deferred: a 2-D tensor of a type whose codes a quantized layer keeps (`gguf_codes.
            METHODS`) comes back deferred (`gguf_codes.is_deferred`: a meta tensor holding
            only the file's bytes; `gguf_codes.floats` makes its floats), so that a layer that
            keeps its codes never holds its float32 copy.

    Raises:
        ModelDirectoryError: the file ends inside the tensor, or a row is not whole blocks.
    """
    import gguf

    qtype = gguf.GGMLQuantizationType(tensor.ggml_type)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row = tensor.shape[-1] if tensor.shape else 1
    if row % block:
        raise ModelDirectoryError(
            f"GGUF file {path}: tensor {tensor.name!r} rows of {row} are not whole "
            f"{qtype.name} blocks of {block}"
        )
    size = math.prod(tensor.shape) // block * type_size
    shape = tuple(int(d) for d in tensor.shape)

    def dequantized(raw: np.ndarray) -> torch.Tensor:
        if qtype == gguf.GGMLQuantizationType.F32:
            values = raw.view(np.float32)
        else:
            values = gguf.quants.dequantize(raw.reshape(-1, row // block * type_size), qtype)
        array = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
        return torch.from_numpy(array)

    if len(shape) == 2 and deferred and qtype.name in gguf_codes.METHODS:
        # Nothing is read now: the codes (or floats) are read from the file when a layer
        # asks, so the loaded model never holds the file's bytes beside its panels.
        def read() -> np.ndarray:
            with path.open("rb") as again:
                return _read_raw(path, again, tensor, size)

        rows_cols = (shape[0], shape[1])
        weight = torch.empty(shape, dtype=torch.float32, device="meta")
        return gguf_codes.attach(weight, gguf_codes.FileTensor(
            qtype.name, lambda: gguf_codes.decode(read(), qtype.name, rows_cols),
            lambda: dequantized(read())))
    raw = _read_raw(path, handle, tensor, size)
    if len(shape) != 2:
        return dequantized(raw)
    # The type picks the layer's panels under "gguf"; a layer quantized by the codes'
    # method keeps them (decoded only if one asks).
    rows_cols = (shape[0], shape[1])
    decoder = (None if qtype.name not in gguf_codes.METHODS
               else lambda: gguf_codes.decode(raw, qtype.name, rows_cols))
    return gguf_codes.attach(dequantized(raw), gguf_codes.FileTensor(qtype.name, decoder))


def _read_raw(path: Path, handle: io.BufferedReader, tensor: TensorInfo, size: int
              ) -> np.ndarray:
    """The `size` bytes of `tensor`, read into a buffer of their own.

    Raises:
        ModelDirectoryError: the file ends inside the tensor.
    """
    raw = np.empty(size, dtype=np.uint8)
    handle.seek(tensor.offset)
    if handle.readinto(raw.data) != raw.size:
        raise ModelDirectoryError(f"GGUF file {path} is truncated inside tensor {tensor.name!r}")
    return raw


def unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's q/k row order for `n_head` heads (weights and biases)."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def iterate_weights(
    path: Path, tensors: tuple[TensorInfo, ...], hf_config: dict[str, Any], *, permuted: bool,
    deferred: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, float32 tensor) for every model tensor of the file.

    Args:
        path: the file.
        tensors: its tensors (checked with `check_tensors`).
        hf_config: the config dict (num_attention_heads, num_key_value_heads).
        permuted: q/k rows are in llama.cpp's order (the "llama" architecture).
        deferred: yield code-holding 2-D tensors deferred (see `read_tensor`).
    """
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    with path.open("rb") as handle:
        for tensor in tensors:
            name = hf_name(tensor.name)
            if name is None:
                continue
            weight = read_tensor(path, handle, tensor, deferred=deferred)
            n_head = (heads if ".self_attn.q_proj." in name
                      else kv_heads if ".self_attn.k_proj." in name else 0)
            if permuted and n_head:
                weight = _unpermuted(weight, n_head)
            yield name, weight


def _unpermuted(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """`unpermute`, carrying the type, codes and deferred floats `weight` may have along (in
    the same order)."""
    out = unpermute(weight, n_head)
    source = gguf_codes.source_of(weight)
    if source is None:
        return out
    if source.decoder is None and source.dequantized is None:
        return gguf_codes.attach(out, source)

    def decoder() -> gguf_codes.BlockCodes:
        blocks = source.codes()
        assert blocks is not None
        return blocks.map_rows(lambda t: unpermute(t, n_head))

    make = source.dequantized
    dequantized = None if make is None else lambda: unpermute(make(), n_head)
    return gguf_codes.attach(out, gguf_codes.FileTensor(
        source.qtype, None if source.decoder is None else decoder, dequantized))
