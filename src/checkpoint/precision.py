"""The dtype and weight format a checkpoint is served in, and the start-up line that says
which and why.

`ringserve.config.ModelConfig.from_model_dir` asks here once per engine config, in the
process that builds it (the CLI's, or the one calling `LLM(...)`):

- `resolve_dtype`: what `--dtype auto` means. On CUDA the checkpoint's own dtype. On CPU
  float32 activations; a bf16 checkpoint keeps its weights in bf16 (`cpu_weight_format`).
- `cpu_weight_format`: under `--dtype auto` on CPU a bf16 checkpoint's linears and LM head
  stay bf16, in bf16 panels (`ringserve.gpu.native.panel`, `panel_bf16.c`: the bf16 bits
  widened to float32 in registers), and the model computes in float32 around them. A decode
  step reads half the bytes float32 panels would (it is bound by them), and every product is
  float32 arithmetic on the checkpoint's own values: decodes and prefill chunks under 512
  tokens give what a float32 model loaded from the same checkpoint gives, more precise than
  bf16 activations (`--dtype bfloat16`, torch's bf16 matmuls, no fused decode step) and,
  measured, faster (issue 48). Widening needs no native bf16, so this holds on any x86 CPU.
  On a CPU with native bf16 (AVX512-BF16 / AMX-BF16), a prefill chunk of 512 tokens or more
  multiplies and attends in bf16 as any bf16 model does (oneDNN's AMX GEMM, torch's bf16
  flash attention: 2.5x float32's prefill speed at 4,096 tokens); elsewhere it stays float32.
  The KV cache stays float32.
- `gguf_quantization`: a quantized GGUF file is served from its codes by default, as vLLM
  serves GGUF files: `quantization="gguf"` puts every linear and the LM head on the panels its
  tensors' types ask for (`ringserve.checkpoint.gguf_codes.layer_method`: Q4_0 / Q4_1 / Q4_K
  codes on int4 panels, Q8_0 codes on int8 panels, other quantized types rounded to int8
  panels, float tensors float). The int4 / int8 panels are CPU kernels: on CUDA the file is
  dequantized to the compute dtype, as before. `--gguf-dequantize` asks for that float model
  on CPU too.
- `announce`: the one INFO line naming the dtype and weight format chosen and why, and the
  one WARNING for `--dtype bfloat16` on a CPU without native bf16 (each once per process).

The CPU's features come from `cpu_flags` (/proc/cpuinfo), which tests replace.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringserve.checkpoint import gguf_codes
from ringserve.checkpoint.support import DType

logger = logging.getLogger(__name__)

TORCH_DTYPE_NAMES: dict[str, DType] = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
# /proc/cpuinfo flags of native bf16 arithmetic: AVX512-BF16 (vdpbf16ps) and AMX-BF16 tiles.
BF16_FEATURES = ("avx512_bf16", "amx_bf16")
DEQUANTIZE_FLAG = "--gguf-dequantize"
BF16_WEIGHTS = "bf16"
"""`ModelConfig.weight_format` of a bf16 checkpoint served on CPU: bf16 panels, float32
compute (the layers take it through their `quantization` seam: it is not a quantization,
the weights are the checkpoint's own)."""
# GGUF tensors fused into one layer (ringserve.gpu.models' q/k/v and gate/up projections).
_FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))
_LINEARS = frozenset({"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                      "ffn_down"})
_announced: set[str] = set()  # lines already logged by this process


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (x86 `flags`, Arm `Features`;
    empty where the file cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16_features() -> tuple[str, ...]:
    """The native bf16 features (`BF16_FEATURES`) this CPU has."""
    flags = cpu_flags()
    return tuple(f for f in BF16_FEATURES if f in flags)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AVX512-BF16 or AMX-BF16)."""
    return bool(native_bf16_features())


def stored_dtype(hf: dict[str, Any]) -> DType:
    """The dtype config.json says the weights are stored in (float32 when it does not say)."""
    stored = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return TORCH_DTYPE_NAMES.get(str(stored).removeprefix("torch."), "float32")


def resolve_dtype(dtype: str, hf: dict[str, Any], device: str) -> tuple[DType, str]:
    """The compute dtype, and why (for the start-up line); see the module docstring.

    Raises:
        ValueError: `dtype` is not one of auto, float32, float, bfloat16, float16, half.
    """
    if dtype != "auto":
        if dtype not in TORCH_DTYPE_NAMES:
            raise ValueError(f"dtype: got {dtype!r}, allowed: auto, float32, bfloat16, float16")
        chosen = TORCH_DTYPE_NAMES[dtype]
        if chosen == "bfloat16" and device == "cpu":
            # What a vLLM command line often says; on CPU it is the slower way to serve bf16.
            return chosen, (f"--dtype {dtype}: bf16 activations and KV cache on torch's bf16 "
                            "matmuls; --dtype auto keeps a bf16 checkpoint's weights in bf16 "
                            "panels around float32 compute, 2-3x faster decode measured")
        return chosen, f"--dtype {dtype}"
    stored = stored_dtype(hf)
    if device == "cuda" or stored == "float32":
        return stored, f"the checkpoint's dtype{' (cuda)' if device == 'cuda' else ''}"
    if stored == "float16":
        return "float32", ("--dtype auto serves the checkpoint's float16 in float32 on CPU (no "
                           "float16 matmuls of its own there)")
    return "float32", ("--dtype auto computes in float32 on CPU around the checkpoint's "
                       "bfloat16 weights, kept in bf16 panels: half the bytes a token reads, "
                       "float32 products; --dtype bfloat16 for bf16 activations")


def cpu_weight_format(dtype: str, hf: dict[str, Any], device: str,
                      quantization: str | None, load_format: str) -> str | None:
    """`BF16_WEIGHTS` when a bf16 checkpoint is served on CPU under `--dtype auto` (its
    linears and LM head in bf16 panels, see the module docstring), else None (the weights in
    the compute dtype, or quantized)."""
    if (dtype != "auto" or device != "cpu" or quantization is not None
            or load_format == "gguf"):
        return None
    return BF16_WEIGHTS if stored_dtype(hf) == "bfloat16" else None


def bf16_warning(dtype: DType, device: str) -> str | None:
    """The warning for bf16 compute on a CPU without native bf16 (None: nothing to warn)."""
    if dtype != "bfloat16" or device != "cpu" or cpu_has_native_bf16():
        return None
    return (f"--dtype bfloat16: this CPU lacks {' and '.join(BF16_FEATURES)} (no native bf16 "
            "in /proc/cpuinfo), so torch emulates bf16 matmuls, slower than float32; serving "
            "bf16 anyway (--dtype auto serves float32)")


@dataclass(frozen=True)
class GGUFTensor:
    """What the default needs of one GGUF tensor: its name, type and number of dimensions."""

    name: str
    qtype: str
    ndim: int


def gguf_quantization(tensors: Sequence[GGUFTensor], asked: str | None, device: str, *,
                      dequantize: bool) -> tuple[str | None, str]:
    """The quantization a GGUF file is served with, and how its weights end up (for the
    start-up line).

    Args:
        tensors: the file's tensors (from its header).
        asked: `--quantization` (None: not given).
        device: the resolved device.
        dequantize: `--gguf-dequantize` was given.
    """
    quantized = sorted({t.qtype for t in _head_and_linears(tensors)}
                       - set(gguf_codes.FLOAT_TYPES))
    blocks = ", ".join(quantized)
    if asked is not None:
        return asked, f"{_describe(tensors, asked)}: --quantization {asked}"
    if not quantized:
        types = ", ".join(sorted({t.qtype for t in _head_and_linears(tensors)}))
        return None, f"from the GGUF file's {types} tensors"
    if dequantize:
        return None, f"dequantized from the GGUF file's {blocks} blocks: {DEQUANTIZE_FLAG}"
    if device != "cpu":
        return None, (f"dequantized from the GGUF file's {blocks} blocks: the int4 / int8 "
                      f"panels that serve a GGUF file from its codes run on CPU only "
                      f"(device {device})")
    mode = gguf_codes.GGUF_MODE
    return mode, (f"{_describe(tensors, mode)}: a quantized GGUF file is served from its "
                  f"codes by default, as vLLM does ({DEQUANTIZE_FLAG} for float weights)")


def _head_and_linears(tensors: Sequence[GGUFTensor]) -> list[GGUFTensor]:
    """The tensors of the linear layers and the LM head (the tied embedding when the file
    has no `output.weight`)."""
    names = {t.name for t in tensors}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    return [t for t in tensors if t.ndim == 2 and (t.name == head or _linear_part(t.name))]


def _linear_part(name: str) -> str | None:
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LINEARS and parts[3] == "weight":
        return parts[2]
    return None


def _describe(tensors: Sequence[GGUFTensor], mode: str) -> str:
    """Where the head's and the linears' tensors go under `mode` ("gguf", or one method),
    by the rule the layers apply at load (`gguf_codes.layer_method`)."""
    by_layer: dict[tuple[str, ...], list[GGUFTensor]] = {}
    head: list[GGUFTensor] = []
    for t in _head_and_linears(tensors):
        part = _linear_part(t.name)
        if part is None:
            head.append(t)
            continue
        fused = next((group for group in _FUSED if part in group), (part,))
        by_layer.setdefault((t.name.split(".")[1], *fused), []).append(t)
    counts: Counter[tuple[str | None, str]] = Counter()
    for parts in by_layer.values():
        method = _method(mode, parts)
        for t in parts:
            counts[(method, t.qtype)] += 1
    pieces = [_piece(mode, method, qtype, n) for (method, qtype), n in
              sorted(counts.items(), key=lambda item: -item[1])]
    for t in head:
        pieces.append("the LM head on " + _piece(mode, _method(mode, [t]), t.qtype, 0))
    return "; ".join(pieces) + "; embedding lookups and norms float32"


def _method(mode: str, parts: Sequence[GGUFTensor]) -> str | None:
    if mode == gguf_codes.GGUF_MODE:
        return gguf_codes.layer_method(t.qtype for t in parts)
    return mode


def _piece(mode: str, method: str | None, qtype: str, count: int) -> str:
    """How `count` tensors of `qtype` are served on `method`'s panels (0: one, uncounted)."""
    of = f"{count} tensor{'s' if count != 1 else ''}" if count else ""
    if mode == gguf_codes.GGUF_MODE and method != gguf_codes.panel_method(qtype):
        of = f"{of}, fused with a more precise part" if of else "fused with a more precise part"
    of = f" ({of})" if of else ""
    if method is None:
        return f"float32 from {qtype}{of}"
    if gguf_codes.METHODS.get(qtype) == method:
        return f"{method} panels from the file's {qtype} codes{of}"
    return f"{method} panels rounded from {qtype}{of}"


def startup_line(dtype: DType, dtype_why: str, quantization: str | None,
                 gguf_weights: str | None, weight_format: str | None = None) -> str:
    """The start-up line: the dtype and weight format chosen, and why.

    Args:
        dtype: the compute dtype, and `dtype_why` why (`resolve_dtype`).
        quantization: the quantization the config carries.
        gguf_weights: a GGUF file's weights as `gguf_quantization` described them (None: not
            a GGUF file).
        weight_format: `cpu_weight_format`'s choice (None: the weights in `dtype`).
    """
    head = f"dtype {dtype} ({dtype_why}); weights "
    if weight_format == BF16_WEIGHTS:
        return (f"{head}bf16 panels for the linears and the LM head (the checkpoint's own "
                "bf16 values; a tied embedding reads its rows there); norms and the KV "
                "cache float32")
    if gguf_weights is not None:
        if quantization is None:
            return f"{head}{dtype}, {gguf_weights}"
        return f"{head}{gguf_weights}"
    if quantization is None:
        return f"{head}{dtype}"
    return (f"{head}{quantization} panels, rounded from the checkpoint's floats at load: "
            f"--quantization {quantization}")


def announce(line: str, warning: str | None = None) -> None:
    """Log the start-up line (INFO) and `warning` (WARNING), each once per process."""
    if line not in _announced:
        _announced.add(line)
        logger.info("%s", line)
    if warning is not None and warning not in _announced:
        _announced.add(warning)
        logger.warning("%s", warning)
