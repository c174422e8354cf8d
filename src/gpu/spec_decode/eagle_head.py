"""An EAGLE head as a module: its decoder layer(s) over the paged KV cache, its input
projection (`fc`) and its output (norm, LM head and draft-to-target vocabulary map).

EAGLE-3 (`method: "eagle3"`; Li et al. 2025, the layout vLLM and SGLang load): the target's
hidden states entering three of its layers are concatenated and projected, `fc: 3H -> H`;
the first layer's attention reads `[input_layernorm(embed(token)), hidden_norm(h)]` (2H wide)
with the residual stream starting from `h` (or from `hidden_norm(h)` under
`norm_before_residual`); later layers are Llama layers; the output is `norm(stream)` through
the head's own LM head over its draft vocabulary, whose ids map to the target's by `d2t`
(`target = draft + d2t[draft]`). The stream before the norm is the hidden state of the next
draft step.

EAGLE-1/2 (`method: "eagle"`): `fc: 2H -> H` over `[embed(token), h]` with `h` the target's
final normed hidden state; Llama layers whose first has no input norm; no final norm; the
target's LM head; the stream is also the next step's hidden state.

The token embedding is the target's (vocabulary-parallel like the target's) unless the head
ships its own `embed_tokens`. The head's own layers are not sharded: every tensor-parallel rank
runs all of it (a head is one layer of the target's width). Built and loaded by
`load_eagle_head`; driven by `ringserve.gpu.spec_decode.eagle.EagleProposer`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ringserve.checkpoint.safetensors_file import (
    FLOAT_DTYPES,
    TensorReader,
    checkpoint_files,
    read_header,
)
from ringserve.config import ModelConfig
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.attention.metadata import AttentionMetadata
from ringserve.gpu.layers.linear import ColumnParallelLinear, RowParallelLinear
from ringserve.gpu.layers.norm import RMSNorm
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.layers.rotary import RotaryEmbedding, rope_parameters
from ringserve.gpu.layers.vocab_embedding import VocabParallelEmbedding
from ringserve.gpu.models.llama import PACKED, LlamaAttention, LlamaForCausalLM, LlamaMLP
from ringserve.gpu.models.spec import DecoderSpec
from ringserve.gpu.spec_decode.eagle_config import EagleHeadConfig

_ONE = TPGroup()  # the head's own layers run whole on every rank


class EagleLayer(nn.Module):
    """One of the head's decoder layers (`first`: the layer that takes the 2H input)."""

    def __init__(self, head: EagleHeadConfig, spec: DecoderSpec, backend: AttentionBackend,
                 rotary: RotaryEmbedding, first: bool) -> None:
        super().__init__()
        self.eagle3 = head.method == "eagle3"
        self.first = first
        self.self_attn = LlamaAttention(spec, _ONE, backend, rotary)
        if first and self.eagle3:  # [embedding, hidden] -> q, k, v
            d = spec.head_dim
            self.self_attn.qkv_proj = ColumnParallelLinear(
                2 * spec.hidden_size,
                [spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d],
                bias=spec.qkv_bias, tp=_ONE, dtype=spec.dtype)
        self.mlp = LlamaMLP(spec, _ONE)
        eps, size = spec.rms_norm_eps, spec.hidden_size
        # EAGLE-1's first layer has no input norm (its input is fc's output).
        self.input_layernorm = (RMSNorm(size, eps, spec.dtype)
                                if self.eagle3 or not first else None)
        self.post_attention_layernorm = RMSNorm(size, eps, spec.dtype)
        self.hidden_norm = RMSNorm(size, eps, spec.dtype) if first and self.eagle3 else None
        self.norm_before_residual = head.norm_before_residual

    def forward(self, positions: torch.Tensor, stream: torch.Tensor, embeds: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream after this layer (`embeds`: the tokens' embeddings, read by
        EAGLE-3's first layer only)."""
        if self.hidden_norm is not None:
            assert embeds is not None and self.input_layernorm is not None
            normed = self.hidden_norm.forward(stream)
            if self.norm_before_residual:
                stream = normed
            x = torch.cat([self.input_layernorm.forward(embeds), normed], dim=-1)
        elif self.input_layernorm is not None:
            x = self.input_layernorm.forward(stream)
        else:
            x = stream
        stream = stream + self.self_attn.forward(positions, x, kv_cache, meta)
        return stream + self.mlp.forward(self.post_attention_layernorm.forward(stream))


class EagleHead(nn.Module):
    """The head (see the module docstring). `target` returns the model being served (a weight
    update swaps it), which lends its embedding and, where the head has none of its own, its
    LM head."""

    d2t: torch.Tensor  # [draft vocabulary] target id - draft id

    def __init__(self, head: EagleHeadConfig, target_config: ModelConfig,
                 target: Callable[[], LlamaForCausalLM], backend: AttentionBackend) -> None:
        super().__init__()
        self.config = head
        hf = head.hf
        dtype = target().spec.dtype
        self.spec = DecoderSpec(
            vocab_size=head.vocab_size, hidden_size=head.hidden_size,
            intermediate_size=head.intermediate_size, num_layers=head.num_layers,
            num_heads=head.num_heads, num_kv_heads=head.num_kv_heads, head_dim=head.head_dim,
            rms_norm_eps=head.rms_norm_eps,
            max_position=max(int(hf.get("max_position_embeddings") or 0),
                             target_config.max_model_len),
            rope=rope_parameters(hf), qkv_bias=bool(hf.get("attention_bias", False)),
            qk_norm=False, mlp_bias=bool(hf.get("mlp_bias", False)), tie_word_embeddings=False,
            dtype=dtype)
        self.eagle3 = head.method == "eagle3"
        self.rotary = RotaryEmbedding(head.head_dim, self.spec.max_position, self.spec.rope)
        self.layers = nn.ModuleList(
            EagleLayer(head, self.spec, backend, self.rotary, first=i == 0)
            for i in range(head.num_layers))
        h = head.hidden_size
        names = _tensor_names(head.directory)
        self.fc = ColumnParallelLinear((3 if self.eagle3 else 2) * h, [h],
                                       bias="fc.bias" in names, tp=_ONE, dtype=dtype)
        self.norm = RMSNorm(h, head.rms_norm_eps, dtype) if self.eagle3 else None
        self.own_lm_head = "lm_head.weight" in names
        self.lm_head = (ColumnParallelLinear(h, [head.draft_vocab_size], bias=False, tp=_ONE,
                                             dtype=dtype) if self.own_lm_head else None)
        if not self.own_lm_head and head.draft_vocab_size != head.vocab_size:
            raise ValueError(f"speculative_config.model: the EAGLE head in {head.directory} "
                             f"has a draft vocabulary of {head.draft_vocab_size} but no "
                             f"lm_head.weight")
        self.embed_tokens = (VocabParallelEmbedding(head.vocab_size, h, tp=_ONE, dtype=dtype)
                             if "embed_tokens.weight" in names else None)
        self.register_buffer("d2t", torch.zeros(head.draft_vocab_size, dtype=torch.int64),
                             persistent=False)
        self._target = target

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (the head's own, or the target's)."""
        if self.embed_tokens is not None:
            return self.embed_tokens.forward(token_ids)
        return self._target().model.embed_tokens.forward(token_ids)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                project: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(output rows for the logits, the stream each row hands to the next draft step).

        Args:
            token_ids: [T] the tokens at the queries' next positions.
            positions: [T] the queries' positions.
            hidden: [T, F]: the target's features (`project`: through `fc` first; EAGLE-3's
                three layers concatenated, or EAGLE-1's final hidden state) or the previous
                draft step's stream.
            project: `hidden` is the target's (True) or the head's own (False).
        """
        embeds = self.embed(token_ids).to(hidden.dtype)
        if self.eagle3:
            stream = self.fc.forward(hidden) if project else hidden
        else:
            stream = self.fc.forward(torch.cat([embeds, hidden], dim=-1))
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            assert isinstance(layer, EagleLayer)
            stream = layer.forward(positions, stream, embeds if i == 0 else None, kv_cache, meta)
        out = self.norm.forward(stream) if self.norm is not None else stream
        return out, stream

    def draft_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """The greedy draft (a target token id) of each output row."""
        if self.lm_head is None:
            return self._target().compute_logits(out).argmax(dim=-1)
        best = self.lm_head.forward(out).argmax(dim=-1)
        return best + self.d2t[best]

    def load(self) -> None:
        """Read the head's weights (names as published: `midlayer.` is layer 0; `t2d` is not
        needed) and pack them for the device.

        Raises:
            ValueError: a tensor that matches nothing, a missing one, or a wrong shape.
        """
        modules = dict(self.named_modules())
        expected = {(name.rpartition(".")[0], name.rpartition(".")[2])
                    for name, _ in self.named_parameters()}
        loaded: set[tuple[str, str]] = set()
        shards: dict[str, set[int]] = {}
        files = checkpoint_files(Path(self.config.directory))
        for name, tensor in TensorReader(files):
            name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
            if name == "t2d":
                continue
            if name == "d2t":
                if tuple(tensor.shape) != tuple(self.d2t.shape):
                    raise ValueError(f"d2t: shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(self.d2t.shape)} (draft_vocab_size)")
                self.d2t.copy_(tensor.to(torch.int64))
                loaded.add(("", "d2t"))
                continue
            module_name, _, param = name.rpartition(".")
            owner, _, leaf = module_name.rpartition(".")
            fused, shard = PACKED.get(leaf, (leaf, 0))
            target = f"{owner}.{fused}" if owner else fused
            if (target, param) not in expected:
                raise ValueError(f"EAGLE head tensor {name!r} matches no part of the head")
            modules[target].load(param, tensor, shard)
            shards.setdefault(f"{target}.{param}", set()).add(shard)
            loaded.add((target, param))
        missing = sorted(f"{m}.{p}" if m else p for m, p in expected - loaded)
        if self.lm_head is not None and self.config.draft_vocab_size != self.config.vocab_size \
                and ("", "d2t") not in loaded:
            missing.append("d2t")
        for name, got in shards.items():
            module = modules[name.rpartition(".")[0]]
            if isinstance(module, ColumnParallelLinear) and len(got) != len(module.local_sizes):
                missing.append(f"{name} (a part of the fused projection)")
        if missing:
            raise ValueError(f"the EAGLE head in {self.config.directory} lacks {missing[:5]}")
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.process_weights_after_loading()


def _tensor_names(directory: str) -> set[str]:
    """The head's tensor names as the loader will see them.

    Raises:
        ValueError: a weight that is not floating point (only `d2t` / `t2d` are integers).
    """
    names: set[str] = set()
    for path in checkpoint_files(Path(directory)):
        for entry in read_header(path):
            name = entry.name.removeprefix("model.").replace("midlayer.", "layers.0.")
            if name not in ("d2t", "t2d") and entry.dtype not in FLOAT_DTYPES:
                raise ValueError(f"{path}: tensor {entry.name!r} has dtype {entry.dtype}; an "
                                 f"EAGLE head's weights must be {', '.join(FLOAT_DTYPES)}")
            names.add(name)
    return names


def load_eagle_head(head: EagleHeadConfig, target_config: ModelConfig,
                    target: Callable[[], LlamaForCausalLM], backend: AttentionBackend,
                    device: torch.device) -> EagleHead:
    """Build the head for `target` and load its weights."""
    module = EagleHead(head, target_config, target, backend).to(device)
    module.load()
    return module
