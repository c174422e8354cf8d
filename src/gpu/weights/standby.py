"""What a weight update loads into: a standby copy of the serving model that is swapped in,
or a staging copy whose weights are repacked into the serving model.

`ringserve.gpu.weights.update` asks `make_target` once, at the first round:

- **Standby** (float32 panels on CPU, or plain weights): a second model, built and processed
  like the serving one. A round's tensors go through the model's own `load_weights` straight
  into its serving layout (`ColumnParallelLinear.load` packs into the panels, a tied
  embedding into its LM head's panels, where its lookups read it), so each byte is read once
  from the transport and written once. `finish` swaps it in between two steps (`ModelRunner.swap_model`, which
  captures the decode step again over it) and the replaced model becomes the standby of the
  next round: two sets of weights, used alternately. The serving model is never written.
- **Staging** (quantized panels, oneDNN copies, packed experts: layouts derived from a plain
  weight that the serving layer no longer keeps): a plain, unprocessed copy; `finish`
  repacks it into the serving model's own tensors in place (`refresh_weights`).

Either way a round that fails leaves the serving model as it was; a round always rewrites
every parameter (`load_weights` refuses one with a tensor missing), so what a failed round
left half-written in the standby is overwritten before it can be served.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringserve.config import EngineConfig
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    loads_in_place,
    refresh_layer,
)
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.layers.vocab_embedding import ParallelLMHead
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.models.registry import model_class
from ringserve.gpu.moe.layer import FusedMoE


@dataclass
class Target:
    """The model a round loads into, and whether `finish` swaps it in (standby) or repacks
    it into the serving model (staging)."""

    model: LlamaForCausalLM
    standby: bool


def standby_unsupported(model: LlamaForCausalLM) -> str | None:
    """Why `model` cannot be served by a swapped-in standby copy (a layer whose serving layout
    is derived from a plain weight it no longer keeps), or None when it can."""
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            return f"{name} packs its experts"
        if isinstance(module, ColumnParallelLinear | RowParallelLinear) and not loads_in_place(
                module):
            kind = f"{module.panel.format} panels" if module.panel is not None else "oneDNN"
            return f"{name} serves {kind}"
        if isinstance(module, ParallelLMHead) and not module.loads_in_place():
            return f"{name} serves a repacked weight"
    return None


def make_target(config: EngineConfig, tp: TPGroup, device: torch.device,
                backend: AttentionBackend, serving: LlamaForCausalLM) -> tuple[Target, str]:
    """The model rounds load into for `serving` (built now), and, for a staging copy, why the
    standby swap does not apply (empty for a standby)."""
    cls = model_class(config.model_config.architecture)
    reason = standby_unsupported(serving)
    with torch.device(device):
        model = cls.from_config(config.model_config, tp, backend)
    if reason is None:
        model.process_weights_after_loading()  # the serving layout, filled by each round
        return Target(model.eval(), standby=True), ""
    return Target(model, standby=False), reason


def refresh_weights(serving: LlamaForCausalLM, loaded: LlamaForCausalLM) -> None:
    """Rewrite `serving`'s weights in place from `loaded`, the same architecture with its
    weights just loaded and not processed: each linear layer and the LM head repack into
    their own panels (`ringserve.gpu.layers.linear.refresh_layer`), the experts of an MoE layer into
    theirs (`FusedMoE.refresh_from`); every other parameter the serving model keeps (norms,
    the embedding, routers) is copied."""
    pairs = zip(serving.named_modules(), loaded.named_modules(), strict=True)
    for (name, mine), (other_name, theirs) in pairs:
        if name != other_name:
            raise RuntimeError(f"weight update: module {name!r} against {other_name!r}")
        if isinstance(mine, ColumnParallelLinear | RowParallelLinear):
            refresh_layer(mine, theirs)
        elif isinstance(mine, ParallelLMHead):
            mine.refresh_from(theirs)
        elif isinstance(mine, FusedMoE):
            assert isinstance(theirs, FusedMoE)
            mine.refresh_from(theirs)
        else:
            for pname, param in mine.named_parameters(recurse=False):
                if param.numel():
                    param.data.copy_(getattr(theirs, pname).data)
