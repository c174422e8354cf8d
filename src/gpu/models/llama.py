"""The Llama decoder on a paged KV cache: Llama itself, and the base of Mistral, Qwen2, Qwen3.

Module names mirror transformers' (`model.layers.N.self_attn...`) so checkpoint names map onto
them; q/k/v and gate/up are fused into one column-parallel projection each (`PACKED` says how
checkpoint names map onto the fused shards). The loader (`ringserve.gpu.weights.loader`) builds a model
from the registry and calls `load_weights`; the model runner calls `forward` on a flat batch
and `compute_logits` on the rows it samples. Submodules are called through `.forward(...)` so
the types stay precise (torch's `Module.__call__` returns Any); no hooks are used here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.config import ModelConfig
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.attention.metadata import AttentionMetadata
from ringserve.gpu.layers.linear import ColumnParallelLinear, RowParallelLinear
from ringserve.gpu.layers.norm import RMSNorm
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.layers.rotary import RotaryEmbedding
from ringserve.gpu.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from ringserve.gpu.models.spec import DecoderSpec

# checkpoint sub-module name -> (fused module name, shard index)
PACKED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    """Self-attention with GQA, rope, optional qkv bias and q/k norm, over the paged cache."""

    def __init__(
        self, spec: DecoderSpec, tp: TPGroup, backend: AttentionBackend, rotary: RotaryEmbedding
    ) -> None:
        super().__init__()
        d = spec.head_dim
        self.num_heads = tp.shard_size(spec.num_heads, "num_attention_heads")
        kv_shards = spec.num_kv_heads if spec.num_kv_heads < tp.world_size else tp.world_size
        if spec.num_kv_heads < tp.world_size and tp.world_size % spec.num_kv_heads:
            raise ValueError(
                f"num_key_value_heads ({spec.num_kv_heads}) must divide tensor_parallel_size "
                f"({tp.world_size}) when it is smaller"
            )
        self.num_kv_heads = max(1, spec.num_kv_heads // tp.world_size)
        self.head_dim = d
        self.scale = d**-0.5
        self.qkv_proj = ColumnParallelLinear(
            spec.hidden_size,
            [spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d],
            bias=spec.qkv_bias, tp=tp, dtype=spec.dtype,
            shard_ranks=[tp.world_size, kv_shards, kv_shards], quantization=spec.quantization,
        )
        self.o_proj = RowParallelLinear(
            spec.num_heads * d, spec.hidden_size, bias=False, tp=tp, dtype=spec.dtype,
            quantization=spec.quantization,
        )
        self.q_norm = RMSNorm(d, spec.rms_norm_eps, spec.dtype) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.rms_norm_eps, spec.dtype) if spec.qk_norm else None
        self.backend = backend
        self.rotary = [rotary]  # a list, so the shared table is not registered once per layer
        # Set per layer by families that need them (Gemma); passed through to the backend.
        self.sliding_window: int | None = spec.sliding_window
        self.logits_soft_cap: float | None = None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention output [T, hidden] for hidden states [T, hidden]."""
        t, d = hidden.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qkv = self.qkv_proj.forward(hidden)
        v = qkv[:, q_size + kv_size :].reshape(t, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm.forward(qkv[:, :q_size].reshape(t, self.num_heads, d))
            k = self.k_norm.forward(qkv[:, q_size : q_size + kv_size].reshape(t, self.num_kv_heads, d))
            q, k = self.rotary[0].forward(positions, q, k)
        else:
            qk = self.rotary[0].rotate(
                positions, qkv[:, : q_size + kv_size].reshape(t, self.num_heads + self.num_kv_heads, d)
            )
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        self.backend.write_kv(k, v, kv_cache, meta.slot_mapping)
        out = self.backend.attend(q, kv_cache, meta, self.scale, sliding_window=self.sliding_window,
                                  logits_soft_cap=self.logits_soft_cap)
        return self.o_proj.forward(out.reshape(t, q_size))


class LlamaMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), gate/up fused and column-parallel."""

    def __init__(self, spec: DecoderSpec, tp: TPGroup) -> None:
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            spec.hidden_size, [size, size], bias=spec.mlp_bias, tp=tp, dtype=spec.dtype,
            quantization=spec.quantization,
        )
        self.down_proj = RowParallelLinear(
            size, spec.hidden_size, bias=spec.mlp_bias, tp=tp, dtype=spec.dtype,
            quantization=spec.quantization,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP output for `x` [T, hidden]."""
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)


class FeedForward(Protocol):
    """A decoder layer's feed-forward block: the dense `LlamaMLP` or a mixture of experts
    (`ringserve.gpu.models.moe`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for `x` [T, hidden]."""
        ...


# layer index -> that layer's feed-forward block (None: the dense LlamaMLP)
MlpFactory = Callable[[int], "FeedForward | None"]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections (`mlp`: another
    feed-forward block than the dense MLP, e.g. a mixture of experts)."""

    def __init__(
        self, spec: DecoderSpec, tp: TPGroup, backend: AttentionBackend, rotary: RotaryEmbedding,
        mlp: FeedForward | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, tp, backend, rotary)
        self.mlp: FeedForward = mlp if mlp is not None else LlamaMLP(spec, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One decoder layer over the flat batch."""
        attn = self.self_attn.forward(
            positions, self.input_layernorm.forward(hidden), kv_cache, meta
        )
        hidden = hidden + attn
        return hidden + self.mlp.forward(self.post_attention_layernorm.forward(hidden))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (`mlp_for_layer`: a layer's own
    feed-forward block, for mixtures of experts; None or a None result: the dense MLP)."""

    def __init__(self, spec: DecoderSpec, tp: TPGroup, backend: AttentionBackend,
                 mlp_for_layer: MlpFactory | None = None) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position, spec.rope)
        self.embed_tokens = VocabParallelEmbedding(
            spec.vocab_size, spec.hidden_size, tp=tp, dtype=spec.dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, tp, backend, self.rotary,
                              mlp_for_layer(i) if mlp_for_layer is not None else None)
            for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.dtype)
        # Run between layers of an eager forward (the model runner's pause check:
        # `ringserve.gpu.runner.decode_capture.abort_check`); None: nothing.
        self.between_layers: Callable[[], None] | None = None
        # Rows that replace token embeddings in the next eager forward (images:
        # `ringserve.gpu.multimodal.runner_seam`): (token rows, embeddings); None: none.
        self.embed_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        # The layers whose input hidden states (the residual stream entering them) the next
        # eager forward keeps in `aux_hidden`, in this order (an EAGLE-3 head reads them:
        # `ringserve.gpu.spec_decode.eagle`); empty: none.
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: list[torch.Tensor] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] for a flat batch of tokens (`between_layers`, when
        set, runs before every layer after the first and may raise to end the step)."""
        hidden = replace_rows(self.embed_tokens.forward(input_ids), self.embed_rows)
        between = self.between_layers
        aux = self.aux_layers
        kept: dict[int, torch.Tensor] = {}
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            assert isinstance(layer, LlamaDecoderLayer)
            if between is not None and i:
                between()
            if i in aux:
                kept[i] = hidden
            hidden = layer.forward(positions, hidden, kv_cache, meta)
        if aux:
            self.aux_hidden = [kept[i] for i in aux]
        return self.norm.forward(hidden)


def replace_rows(hidden: torch.Tensor,
                 rows: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """`hidden` with the rows `rows[0]` replaced by `rows[1]` (an image's embeddings in
    place of its placeholder tokens'); `hidden` itself when `rows` is None."""
    if rows is None:
        return hidden
    index, values = rows
    return hidden.index_copy(0, index, values.to(hidden.dtype))


class DecoderStack(Protocol):
    """What `LlamaForCausalLM` needs of its decoder (`LlamaModel`, or a family's own stack
    such as Gemma's): the token embedding, which a tied LM head shares, and the forward."""

    embed_tokens: VocabParallelEmbedding
    between_layers: Callable[[], None] | None
    embed_rows: tuple[torch.Tensor, torch.Tensor] | None
    aux_layers: tuple[int, ...]
    aux_hidden: list[torch.Tensor]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] for a flat batch of tokens."""
        ...


class LlamaForCausalLM(nn.Module):
    """The decoder plus the (possibly tied) vocabulary-parallel LM head.

    Args:
        spec: the model's shape and options.
        tp: the tensor-parallel group.
        backend: the attention backend every layer uses.
    """

    def __init__(self, spec: DecoderSpec, tp: TPGroup, backend: AttentionBackend) -> None:
        super().__init__()
        self.spec = spec
        self.model: DecoderStack = self.build_model(spec, tp, backend)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp=tp, dtype=spec.dtype,
                                      quantization=spec.quantization)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            # The embedding loads the matrix: it keeps the GGUF codes the head may take.
            self.model.embed_tokens.record_source = spec.quantization is not None

    @classmethod
    def from_config(
        cls, config: ModelConfig, tp: TPGroup, backend: AttentionBackend
    ) -> LlamaForCausalLM:
        """Build the (unloaded) model for `config`.

        Raises:
            ValueError: an unsupported rope type or tensor-parallel split.
        """
        return cls(DecoderSpec.from_model_config(config), tp, backend)

    def build_model(self, spec: DecoderSpec, tp: TPGroup, backend: AttentionBackend) -> DecoderStack:
        """The decoder stack (families with another layer structure override this)."""
        return LlamaModel(spec, tp, backend)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden]; see `LlamaModel.forward`."""
        return self.model.forward(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] for hidden states [N, hidden]."""
        return self.lm_head.compute_logits(hidden)

    def process_weights_after_loading(self) -> None:
        """Repack the loaded weights for the device's fastest GEMM (oneDNN on CPU; see
        `ringserve.gpu.layers.linear`). The loader calls this once, after `load_weights`."""
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.process_weights_after_loading()
        tied = self.spec.tie_word_embeddings
        self.lm_head.process_weights_after_loading(
            keep_weight=tied, tied_to=self.model.embed_tokens if tied else None)
        if self.spec.tie_word_embeddings:
            self.lm_head.tie_panels(self.model.embed_tokens)
        # A GGUF matrix loaded deferred gets its floats unless the lookups read the panels.
        self.model.embed_tokens.materialize()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors one at a time, sharded for this rank.

        Raises:
            ValueError: a checkpoint name matches no parameter, or a parameter (or a fused
                shard of one) is missing from the checkpoint.
        """
        expected = self._expected_shards()
        modules = dict(self.named_modules())  # one walk, not one per tensor (weight updates)
        loaded: set[tuple[str, int]] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (self.spec.tie_word_embeddings and name == "lm_head.weight"):
                continue
            module_name, _, param = name.rpartition(".")
            owner, _, leaf = module_name.rpartition(".")
            fused, shard = PACKED.get(leaf, (leaf, 0))
            target = f"{owner}.{fused}" if owner else fused
            if (f"{target}.{param}", shard) not in expected:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")
            modules[target].load(param, tensor, shard)
            loaded.add((f"{target}.{param}", shard))
        missing = sorted(f"{n}[{s}]" for n, s in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")

    def _expected_shards(self) -> set[tuple[str, int]]:
        expected: set[tuple[str, int]] = set()
        modules = dict(self.named_modules())
        for name, _ in self.named_parameters():
            module = modules[name.rpartition(".")[0]]
            shards = len(module.local_sizes) if isinstance(module, ColumnParallelLinear) else 1
            expected.update((name, s) for s in range(shards))
        return expected
