"""The expert layout of a mixture-of-experts config.json, read without torch.

One place for which decoder layers are sparse and how big their experts are: the model code
(`ringserve.gpu.models.moe.MoeSpec`) builds its layers from it, the analytic FLOPs estimate
(`ringserve.engine.metrics.flops`) counts the activated experts with it, and the expert-load
metrics (`ringserve.engine.metrics.expert_load`) label their series with its layer indices.
Plain Python, so the engine core and the frontend can read it without the model.

The rule (transformers'): Mixtral makes every layer sparse; Qwen3-MoE and Qwen2-MoE make layer
`i` sparse unless `i` is in `mlp_only_layers` or `(i + 1)` is not a multiple of
`decoder_sparse_step`. The dense layers of an MoE model keep the dense MLP of
`intermediate_size`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringserve.config import ModelConfig

# HF architecture -> the MoE family whose config keys it uses.
MOE_FAMILIES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}


@dataclass(frozen=True, slots=True)
class MoeShape:
    """The experts of an MoE model.

    Attributes:
        num_experts: routed experts per sparse layer.
        top_k: experts per token (`num_experts_per_tok`).
        moe_intermediate_size: each routed expert's intermediate size.
        shared_expert_intermediate_size: the gated shared expert's size (0: none).
        renormalize: the top-k probabilities are divided by their sum.
        sparse_layers: the indices of the decoder layers with an MoE block, ascending.
    """

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], family: str, num_layers: int,
                       name: str = "") -> MoeShape:
        """Read a "qwen3_moe", "qwen2_moe" or "mixtral" config.json.

        Args:
            hf: the config.json contents.
            family: the MoE family (a value of `MOE_FAMILIES`).
            num_layers: the decoder layers.
            name: what the error message calls the model (its architecture).

        Raises:
            ValueError: a config without experts, or top-k larger than the expert count.
        """
        if family == "mixtral":
            experts = int(hf.get("num_local_experts") or 0)
            inter = int(hf.get("intermediate_size") or 0)
            renorm, shared = True, 0
            sparse: tuple[int, ...] = tuple(range(num_layers))
        else:
            # transformers 5 writes `num_local_experts`; released checkpoints `num_experts`
            experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
            inter = int(hf.get("moe_intermediate_size") or 0)
            renorm = bool(hf.get("norm_topk_prob", False))
            shared = (int(hf.get("shared_expert_intermediate_size") or 0)
                      if family == "qwen2_moe" else 0)
            step = int(hf.get("decoder_sparse_step") or 1)
            dense_only = set(hf.get("mlp_only_layers") or [])
            sparse = tuple(i for i in range(num_layers) if i not in dense_only
                           and experts > 0 and (i + 1) % step == 0)
        top_k = int(hf.get("num_experts_per_tok") or 0)
        if experts < 1 or not 1 <= top_k <= experts or inter < 1:
            raise ValueError(f"{name or family}: num_experts {experts}, num_experts_per_tok "
                             f"{top_k} and expert intermediate size {inter} must be positive, "
                             "with num_experts_per_tok <= num_experts")
        return cls(num_experts=experts, top_k=top_k, moe_intermediate_size=inter,
                   shared_expert_intermediate_size=shared, renormalize=renorm,
                   sparse_layers=sparse)


def moe_shape(config: ModelConfig) -> MoeShape | None:
    """The experts of `config`'s model, or None for a dense architecture.

    Raises:
        ValueError: an MoE architecture whose expert settings are unusable.
    """
    family = MOE_FAMILIES.get(config.architecture)
    if family is None:
        return None
    return MoeShape.from_hf_config(config.hf_config, family, config.num_hidden_layers,
                                   config.architecture)
