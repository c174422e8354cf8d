"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (a gated shared expert) and Mixtral.

Each is the Llama decoder (`ringserve.gpu.models.llama`) with a sparse MoE block in place of
the dense MLP on the layers the config makes sparse: every layer for Mixtral; for the Qwen
families, layer i unless i is in `mlp_only_layers` or (i + 1) is not a multiple of
`decoder_sparse_step` (transformers' rule, in `ringserve.moe_shape`). The block routes each
token to its top-k experts (`ringserve.gpu.moe.router`, the same float32 softmax / top-k /
renormalisation transformers uses), runs them through `ringserve.gpu.moe.layer.FusedMoE`
(tensor- or expert-parallel), and adds the sigmoid-gated shared expert where the config has
one.

Checkpoint names: the per-expert `mlp.experts.N.{gate,up,down}_proj.weight` (Qwen) and
`block_sparse_moe.experts.N.w{1,3,2}.weight` (Mixtral) are stacked into the layer's `w13` / `w2`
at load; so are transformers 5's already stacked `mlp.experts.gate_up_proj` / `down_proj`
(what a trainer's `state_dict()` sends in a weight update); the router is `mlp.gate.weight` /
`block_sparse_moe.gate.weight`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.config import ModelConfig
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.layers.linear import check_shape
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.models.llama import (
    DecoderStack,
    FeedForward,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from ringserve.gpu.models.spec import DecoderSpec
from ringserve.gpu.moe.dispatch import ep_group
from ringserve.gpu.moe.layer import FusedMoE
from ringserve.gpu.moe.router import select_experts
from ringserve.moe_shape import MoeShape

_CANONICAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's expert names
_EXPERT = re.compile(r"^(?P<owner>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<leaf>\w+)\.weight$")
# transformers 5 holds the experts stacked (what a trainer's state dict sends):
# gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I]
_STACKED = re.compile(r"^(?P<owner>.+\.mlp\.experts)\.(?P<leaf>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class MoeSpec(DecoderSpec):
    """A decoder spec with the mixture-of-experts settings.

    Attributes:
        num_experts: routed experts per sparse layer.
        top_k: experts per token.
        moe_intermediate_size: each routed expert's intermediate size.
        renormalize: divide the top-k probabilities by their sum.
        shared_expert_intermediate_size: the shared expert's size (0: none).
        sparse_layers: the indices of the layers with an MoE block.
    """

    num_experts: int = 0
    top_k: int = 1
    moe_intermediate_size: int = 0
    renormalize: bool = True
    shared_expert_intermediate_size: int = 0
    sparse_layers: frozenset[int] = frozenset()

    @classmethod
    def for_family(cls, config: ModelConfig, family: str) -> MoeSpec:
        """The spec of a "qwen3_moe", "qwen2_moe" or "mixtral" config.

        Raises:
            ValueError: a config without experts, or top-k larger than the expert count.
        """
        hf = config.hf_config
        base = DecoderSpec.from_model_config(
            config, qkv_bias=True if family == "qwen2_moe" else None,
            qk_norm=family == "qwen3_moe", sliding_window=_window(config, family))
        shape = MoeShape.from_hf_config(hf, family, config.num_hidden_layers,
                                        config.architecture)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(DecoderSpec)}
        return cls(**fields, num_experts=shape.num_experts, top_k=shape.top_k,
                   moe_intermediate_size=shape.moe_intermediate_size,
                   renormalize=shape.renormalize,
                   shared_expert_intermediate_size=shape.shared_expert_intermediate_size,
                   sparse_layers=frozenset(shape.sparse_layers))


def _window(config: ModelConfig, family: str) -> int | None:
    hf = config.hf_config
    if family == "mixtral":
        window = hf.get("sliding_window")
        return window if isinstance(window, int) and window > 0 else None
    if hf.get("use_sliding_window"):
        raise ValueError(f"{config.architecture}: use_sliding_window is not supported; "
                         "released checkpoints set it false")
    return None


class RouterGate(nn.Module):
    """A small replicated projection ([out, hidden], no bias): the router, and the shared
    expert's gate."""

    def __init__(self, out_features: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def load(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        """Copy the whole checkpoint tensor (every rank holds all of it)."""
        del name, shard_id
        check_shape(loaded, tuple(self.weight.shape))
        self.weight.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T."""
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """Router, routed experts and the optional gated shared expert of one layer."""

    def __init__(self, spec: MoeSpec, tp: TPGroup) -> None:
        super().__init__()
        self.top_k, self.renormalize = spec.top_k, spec.renormalize
        self.gate = RouterGate(spec.num_experts, spec.hidden_size, spec.dtype)
        self.experts = FusedMoE(spec.num_experts, spec.hidden_size, spec.moe_intermediate_size,
                                tp=tp, ep=ep_group(), dtype=spec.dtype,
                                quantization=spec.quantization)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: RouterGate | None = None
        if spec.shared_expert_intermediate_size:
            shared = dataclasses.replace(spec, intermediate_size=spec.shared_expert_intermediate_size)
            self.shared_expert = LlamaMLP(shared, tp)
            self.shared_expert_gate = RouterGate(1, spec.hidden_size, spec.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for `x` [T, hidden]."""
        weights, ids = select_experts(self.gate.forward(x), self.top_k, self.renormalize, x.dtype)
        out = self.experts.forward(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate.forward(x))
            out = out + gate * self.shared_expert.forward(x)
        return out


class MoeForCausalLM(LlamaForCausalLM):
    """The common MoE model; the families below set `FAMILY`."""

    FAMILY = ""

    @classmethod
    def from_config(
        cls, config: ModelConfig, tp: TPGroup, backend: AttentionBackend
    ) -> LlamaForCausalLM:
        """Build the (unloaded) model for `config`.

        Raises:
            ValueError: an invalid expert configuration or split.
        """
        return cls(MoeSpec.for_family(config, cls.FAMILY), tp, backend)

    def build_model(self, spec: DecoderSpec, tp: TPGroup, backend: AttentionBackend) -> DecoderStack:
        """The Llama stack with sparse blocks on the spec's sparse layers."""
        assert isinstance(spec, MoeSpec)

        def mlp_for(i: int) -> FeedForward | None:
            return SparseMoeBlock(spec, tp) if i in spec.sparse_layers else None

        return LlamaModel(spec, tp, backend, mlp_for)

    def moe_layers(self) -> list[FusedMoE]:
        """The routed experts of every sparse layer, in layer order."""
        return [m for m in self.modules() if isinstance(m, FusedMoE)]

    def process_weights_after_loading(self) -> None:
        """Pack the dense layers (see the base class) and the experts."""
        super().process_weights_after_loading()
        for experts in self.moe_layers():
            experts.process_weights_after_loading()

    def dummy_pass(self) -> None:
        """Take part in every MoE layer's expert-parallel exchange without a token (an idle
        data-parallel rank keeps its peers' collectives from waiting)."""
        weight = self.model.embed_tokens.weight
        for experts in self.moe_layers():
            experts.dummy_pass(self.spec.hidden_size, weight.dtype, weight.device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors; per-expert matrices go into the stacked expert weights.

        Raises:
            ValueError: a tensor matches no parameter, or one is missing.
        """
        seen: set[tuple[str, int, str]] = set()

        def dense() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.replace(".block_sparse_moe.", ".mlp.")
                match = _EXPERT.match(name) or _STACKED.match(name)
                if match is None:
                    yield name, tensor
                    continue
                owner, leaf = match["owner"], match["leaf"]
                module = self._experts_at(owner, name)
                if "expert" in match.groupdict():
                    expert = int(match["expert"])
                    module.load_expert(expert, leaf, tensor)
                    seen.add((owner, expert, _CANONICAL.get(leaf, leaf)))
                    continue
                for expert, part, matrix in _unstack(leaf, tensor, module.num_experts):
                    module.load_expert(expert, part, matrix)
                    seen.add((owner, expert, part))

        super().load_weights(dense())
        missing = [f"{owner}.{e}.{leaf}" for owner, e, leaf in self._expected_experts()
                   if (owner, e, leaf) not in seen]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} expert tensors, e.g. {missing[:5]}")

    def _experts_at(self, owner: str, name: str) -> FusedMoE:
        try:
            module = self.get_submodule(owner)
        except AttributeError:
            module = None
        if not isinstance(module, FusedMoE):
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                             f"{type(self).__name__}")
        return module

    def _expected_experts(self) -> list[tuple[str, int, str]]:
        return [(name, e, leaf) for name, module in self.named_modules()
                if isinstance(module, FusedMoE) for e in range(module.num_experts)
                for leaf in ("gate_proj", "up_proj", "down_proj")]

    def _expected_shards(self) -> set[tuple[str, int]]:
        return {(name, shard) for name, shard in super()._expected_shards()
                if not name.endswith((".experts.w13", ".experts.w2"))}


def _unstack(leaf: str, tensor: torch.Tensor, num_experts: int
             ) -> Iterator[tuple[int, str, torch.Tensor]]:
    """(expert, checkpoint leaf, matrix) of a stacked `gate_up_proj` or `down_proj`.

    Raises:
        ValueError: the tensor is not [num_experts, ...] with an even gate-up row count.
    """
    if tensor.dim() != 3 or tensor.shape[0] != num_experts or (
            leaf == "gate_up_proj" and tensor.shape[1] % 2):
        raise ValueError(f"stacked experts {leaf} of shape {list(tensor.shape)}: expected "
                         f"[{num_experts}, ...] (gate_up_proj: [E, 2 * I, H])")
    for e in range(num_experts):
        if leaf == "down_proj":
            yield e, "down_proj", tensor[e]
        else:
            gate, up = tensor[e].chunk(2, dim=0)
            yield e, "gate_proj", gate
            yield e, "up_proj", up


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE: Qwen3 attention (q/k norm), routed experts, `norm_topk_prob` per config."""

    FAMILY = "qwen3_moe"


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE: qkv bias, routed experts plus a sigmoid-gated shared expert."""

    FAMILY = "qwen2_moe"


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: Mistral attention, every layer sparse, top-k weights renormalised."""

    FAMILY = "mixtral"
