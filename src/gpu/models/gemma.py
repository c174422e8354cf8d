"""Gemma 2 and Gemma 3 (text): the Llama attention and weight layout with Gemma's own decoder.

What differs from Llama, as transformers' `modeling_gemma2` / `modeling_gemma3` compute it:
embeddings scaled by sqrt(hidden_size) (rounded to the activation dtype first), RMSNorm
scaling by `1 + weight` in float32, a norm before and after both the attention and the MLP,
a gated GELU (tanh) MLP, attention scaled by `query_pre_attn_scalar ** -0.5`, sliding-window
and full-attention layers interleaved by the config's `layer_types`, and a tanh soft-cap on the
final logits. Gemma 2 also soft-caps the attention scores; Gemma 3 instead normalises each
query and key head (Gemma-style RMSNorm) and gives its sliding layers their own rope table
(`rope_parameters["sliding_attention"]`, the old `rope_local_base_freq`). Gemma 3's attention
never soft-caps, whatever the config says: transformers does not pass the cap on either.

Only the text model (`Gemma3ForCausalLM`, config `gemma3_text`) is here; the multimodal
`Gemma3ForConditionalGeneration` is in `ringserve.gpu.multimodal.models`. Registered in
`ringserve.gpu.models.registry`; the
logits every consumer sees (sampler, logprobs, grammar masks) come from `compute_logits`, so
they are the capped ones, as transformers returns them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.config import ModelConfig
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.attention.metadata import AttentionMetadata
from ringserve.gpu.layers.norm import RMSNorm
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.layers.rotary import RotaryEmbedding, rope_parameters
from ringserve.gpu.layers.vocab_embedding import VocabParallelEmbedding
from ringserve.gpu.models.llama import (
    DecoderStack,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    replace_rows,
)
from ringserve.gpu.models.spec import DecoderSpec

GemmaFamily = Literal["gemma2", "gemma3"]
SLIDING, FULL = "sliding_attention", "full_attention"

# transformers' ACT2FN names of the activations Gemma checkpoints use, as torch computes them.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True, kw_only=True)
class GemmaSpec(DecoderSpec):
    """`DecoderSpec` plus what Gemma adds (see the module docstring).

    Attributes:
        layer_types: "sliding_attention" or "full_attention", one per layer.
        query_pre_attn_scalar: attention scores are scaled by its inverse square root.
        attn_logit_softcap: the attention-score soft-cap (Gemma 2), or None.
        final_logit_softcap: the output-logit soft-cap, or None.
        hidden_activation: the MLP gate's activation (a key of ACTIVATIONS).
        rope_local: rope settings of the sliding layers (Gemma 3: their own base, never the
            global layers' scaling); None: every layer uses `rope`.
    """

    layer_types: tuple[str, ...]
    query_pre_attn_scalar: float
    attn_logit_softcap: float | None
    final_logit_softcap: float | None
    hidden_activation: str
    rope_local: dict[str, Any] | None

    @classmethod
    def from_gemma_config(cls, config: ModelConfig, family: GemmaFamily) -> GemmaSpec:
        """Derive the spec of a Gemma 2 or Gemma 3 text model.

        Raises:
            ValueError: bidirectional attention, an unknown activation or layer type, a
                layer_types list of the wrong length, or an unsupported rope type.
        """
        hf = config.hf_config
        if hf.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention: got true, allowed: false (ringserve "
                             "serves causal language models only)")
        activation = str(hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh")
        if activation not in ACTIVATIONS:
            raise ValueError(f"hidden_activation: got {activation!r}, allowed: "
                             f"{', '.join(ACTIVATIONS)}")
        layer_types = _layer_types(hf, config.num_hidden_layers, family)
        window = hf.get("sliding_window")
        # The base spec's `rope` is the full-attention layers' (rope_parameters' default).
        rope_local = rope_parameters(hf, layer_type=SLIDING) if family == "gemma3" else None
        attn_cap = hf.get("attn_logit_softcapping") if family == "gemma2" else None
        base = DecoderSpec.from_model_config(
            config, qk_norm=family == "gemma3",
            sliding_window=int(window) if window is not None else None,
        )
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(DecoderSpec)}
        final_cap = hf.get("final_logit_softcapping")
        return cls(
            **fields,
            layer_types=layer_types,
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or config.head_dim),
            attn_logit_softcap=float(attn_cap) if attn_cap is not None else None,
            final_logit_softcap=float(final_cap) if final_cap is not None else None,
            hidden_activation=activation,
            rope_local=rope_local,
        )


def _layer_types(hf: dict[str, Any], num_layers: int, family: GemmaFamily) -> tuple[str, ...]:
    """The config's `layer_types`, or transformers' default when a config lacks them (Gemma 2:
    even layers slide; Gemma 3: every `sliding_window_pattern`-th layer (6) is full)."""
    types = hf.get("layer_types")
    if types is None:
        pattern = 2 if family == "gemma2" else int(hf.get("sliding_window_pattern") or 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"layer_types: got {types!r}, allowed: {num_layers} entries, each "
                         f"{SLIDING!r} or {FULL!r}")
    return tuple(str(t) for t in types)


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by `1 + weight`, computed in float32 and cast back (Gemma's form)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise `x` over its last dimension."""
        if x.dtype == torch.float32:
            # The fused op, bit-identical to the explicit path below in float32.
            return F.rms_norm(x, self.weight.shape, 1.0 + self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(LlamaAttention):
    """Llama's paged attention with Gemma's scale, soft-cap, window and q/k norms.

    Args:
        spec: the model spec.
        tp: the tensor-parallel group.
        backend: the attention backend.
        rotary: this layer's rope table (Gemma 3's sliding layers have their own).
        layer_type: "sliding_attention" or "full_attention".
    """

    def __init__(self, spec: GemmaSpec, tp: TPGroup, backend: AttentionBackend,
                 rotary: RotaryEmbedding, layer_type: str) -> None:
        super().__init__(spec, tp, backend, rotary)
        self.scale = spec.query_pre_attn_scalar**-0.5
        self.sliding_window = spec.sliding_window if layer_type == SLIDING else None
        self.logits_soft_cap = spec.attn_logit_softcap
        if spec.qk_norm:
            self.q_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps, spec.dtype)
            self.k_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps, spec.dtype)


class GemmaMLP(LlamaMLP):
    """down(act(gate(x)) * up(x)) with the config's GELU in place of SiLU."""

    def __init__(self, spec: GemmaSpec, tp: TPGroup) -> None:
        super().__init__(spec, tp)
        self.act = ACTIVATIONS[spec.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP output for `x` [T, hidden]."""
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(self.act(gate) * up)


class GemmaDecoderLayer(nn.Module):
    """Attention and MLP blocks, each between a pre-norm and a post-norm, with residuals."""

    def __init__(self, spec: GemmaSpec, tp: TPGroup, backend: AttentionBackend,
                 rotary: RotaryEmbedding, layer_type: str) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(spec, tp, backend, rotary, layer_type)
        self.mlp = GemmaMLP(spec, tp)
        h, eps, dtype = spec.hidden_size, spec.rms_norm_eps, spec.dtype
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """One decoder layer over the flat batch."""
        attn = self.self_attn.forward(positions, self.input_layernorm.forward(hidden), kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm.forward(attn)
        mlp = self.mlp.forward(self.pre_feedforward_layernorm.forward(hidden))
        return hidden + self.post_feedforward_layernorm.forward(mlp)


class GemmaModel(nn.Module):
    """Scaled embedding, decoder layers and the final norm."""

    def __init__(self, spec: GemmaSpec, tp: TPGroup, backend: AttentionBackend) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position, spec.rope)
        self.rotary_local = (
            RotaryEmbedding(spec.head_dim, spec.max_position, spec.rope_local)
            if spec.rope_local is not None else None
        )
        self.embed_tokens = VocabParallelEmbedding(
            spec.vocab_size, spec.hidden_size, tp=tp, dtype=spec.dtype
        )
        # transformers multiplies by sqrt(hidden) already rounded to the activation dtype.
        self.embed_scale = float(torch.tensor(spec.hidden_size**0.5).to(spec.dtype))
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(spec, tp, backend, self._rotary_for(kind), kind)
            for kind in spec.layer_types
        )
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.dtype)
        self.between_layers: Callable[[], None] | None = None  # as LlamaModel's
        self.aux_layers: tuple[int, ...] = ()  # as LlamaModel's
        self.aux_hidden: list[torch.Tensor] = []
        self.embed_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # as LlamaModel's

    def _rotary_for(self, layer_type: str) -> RotaryEmbedding:
        if layer_type == SLIDING and self.rotary_local is not None:
            return self.rotary_local
        return self.rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [T, hidden] for a flat batch of tokens."""
        # Image rows replace the scaled embeddings (transformers scales token embeddings
        # only).
        hidden = replace_rows(self.embed_tokens.forward(input_ids) * self.embed_scale,
                              self.embed_rows)
        between = self.between_layers
        aux = self.aux_layers
        kept: dict[int, torch.Tensor] = {}
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            assert isinstance(layer, GemmaDecoderLayer)
            if between is not None and i:
                between()
            if i in aux:
                kept[i] = hidden
            hidden = layer.forward(positions, hidden, kv_cache, meta)
        if aux:
            self.aux_hidden = [kept[i] for i in aux]
        return self.norm.forward(hidden)


class _GemmaForCausalLM(LlamaForCausalLM):
    """The Gemma decoder with the (tied) LM head and the final logit soft-cap."""

    family: GemmaFamily

    def __init__(self, spec: GemmaSpec, tp: TPGroup, backend: AttentionBackend) -> None:
        super().__init__(spec, tp, backend)
        self.final_logit_softcap = spec.final_logit_softcap

    @classmethod
    def from_config(
        cls, config: ModelConfig, tp: TPGroup, backend: AttentionBackend
    ) -> LlamaForCausalLM:
        """Build the (unloaded) model for `config`.

        Raises:
            ValueError: see `GemmaSpec.from_gemma_config`; or a tensor-parallel split that
                does not divide the model.
        """
        return cls(GemmaSpec.from_gemma_config(config, cls.family), tp, backend)

    def build_model(self, spec: DecoderSpec, tp: TPGroup, backend: AttentionBackend) -> DecoderStack:
        """The Gemma decoder stack."""
        if not isinstance(spec, GemmaSpec):
            raise TypeError(f"{type(self).__name__} is built from a GemmaSpec, got {type(spec).__name__}")
        return GemmaModel(spec, tp, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab], soft-capped as `cap * tanh(logits / cap)` when the model caps."""
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcap
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


class Gemma2ForCausalLM(_GemmaForCausalLM):
    """Gemma 2: attention and final logit soft-caps, sliding and full layers alternating."""

    family: GemmaFamily = "gemma2"


class Gemma3ForCausalLM(_GemmaForCausalLM):
    """Gemma 3 text: per-head q/k norms, a local rope table for the sliding layers."""

    family: GemmaFamily = "gemma3"
