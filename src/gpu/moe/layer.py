"""`FusedMoE`: the stacked expert weights of one MoE layer, how they are split over the ranks,
loaded from per-expert checkpoint tensors, and applied to routed tokens.

Weights: `w13` [E_local, 2 * I_local, H] (each expert's gate rows, then its up rows) and `w2`
[E_local, H, I_local], stacked at load from the checkpoint's per-expert `gate_proj` / `w1`,
`up_proj` / `w3` and `down_proj` / `w2` matrices.

* Tensor parallelism (the default): every rank holds every expert, with a 1 / tp slice of
  its intermediate size (gate and up split by rows, down by columns, like the dense MLP); the
  partial outputs are summed over the TP group.
* Expert parallelism (`--enable-expert-parallel`, `ringserve.gpu.moe.dispatch`): each rank
  holds E / N whole experts; tokens travel to the owner by all-to-all and come back.

The computation is `ringserve.gpu.moe.grouped` (tokens grouped by expert), through the
project's C kernel over panel weights on CPU (float32, and int8 / int4 with `--quantization`),
through torch's grouped GEMM otherwise, and through the Triton kernel on CUDA.
"""

from __future__ import annotations

import torch
from torch import nn

from ringserve.checkpoint.precision import BF16_WEIGHTS
from ringserve.gpu.layers.linear import check_shape
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.moe import cpu_experts, grouped
from ringserve.gpu.moe.dispatch import EPGroup

# checkpoint leaf name -> (which matrix, shard index within w13)
EXPERT_LEAVES: dict[str, tuple[str, int]] = {
    "gate_proj": ("w13", 0), "w1": ("w13", 0),
    "up_proj": ("w13", 1), "w3": ("w13", 1),
    "down_proj": ("w2", 0), "w2": ("w2", 0),
}


class FusedMoE(nn.Module):
    """The experts of one layer (routing is the caller's: see `router.select_experts`).

    Args:
        num_experts: experts of the layer (global).
        hidden_size, intermediate_size: H and each expert's I (before any split).
        tp: the tensor-parallel group.
        ep: the expert-parallel group, or None for tensor parallelism.
        dtype: parameter dtype.
        quantization: "int8" / "int4" weight-only quantization of the experts (CPU kernel
            only), or None.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 tp: TPGroup, ep: EPGroup | None, dtype: torch.dtype,
                 quantization: str | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.tp, self.ep = tp, ep
        self.quantization = quantization
        if ep is not None:
            self.experts = ep.expert_range(num_experts)
            self.inter = intermediate_size
        else:
            self.experts = range(num_experts)
            self.inter = tp.shard_size(intermediate_size, "moe_intermediate_size")
        self.full_inter = intermediate_size
        self.hidden_size = hidden_size
        e = len(self.experts)
        self.w13 = nn.Parameter(torch.empty(e, 2 * self.inter, hidden_size, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, self.inter, dtype=dtype),
                               requires_grad=False)
        self.packed: cpu_experts.PackedExperts | None = None  # after loading, on CPU
        self.load_counts: torch.Tensor | None = None  # [E] tokens routed, when recorded

    def owns(self, expert: int) -> bool:
        """Whether this rank holds `expert` (always under tensor parallelism)."""
        return expert in self.experts

    def load_expert(self, expert: int, leaf: str, loaded: torch.Tensor) -> None:
        """Copy this rank's part of one checkpoint matrix of `expert` (a no-op for an expert
        another EP rank owns).

        Args:
            expert: the global expert id.
            leaf: the checkpoint leaf ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3").
            loaded: the full [I, H] or [H, I] matrix.

        Raises:
            ValueError: an unknown leaf, expert id or shape.
        """
        if leaf not in EXPERT_LEAVES or not 0 <= expert < self.num_experts:
            raise ValueError(f"expert tensor {expert}.{leaf} matches no parameter "
                             f"({self.num_experts} experts)")
        if not self.owns(expert):
            return
        which, shard = EXPERT_LEAVES[leaf]
        local = expert - self.experts.start
        start = 0 if self.ep is not None else self.tp.rank * self.inter
        hidden = self.hidden_size
        if which == "w13":
            check_shape(loaded, (self.full_inter, hidden))
            rows = loaded.narrow(0, start, self.inter)
            self.w13.data[local].narrow(0, shard * self.inter, self.inter).copy_(rows)
        else:
            check_shape(loaded, (hidden, self.full_inter))
            self.w2.data[local].copy_(loaded.narrow(1, start, self.inter))

    def process_weights_after_loading(self) -> None:
        """Pack the experts for the CPU kernel (float32 panels, or int8 / int4) when it is
        available; the plain weights are dropped then (weight updates: `refresh_from`).

        Raises:
            ValueError: quantization was asked for where the CPU kernel cannot run.
        """
        usable = (self.w13.device.type == "cpu" and self.w13.dtype == torch.float32
                  and cpu_experts.available())
        if usable:
            self.packed = cpu_experts.PackedExperts.pack(self.w13.data, self.w2.data,
                                                         self.quantization)
            # The panels are all the kernel reads: the plain copies go, as for the linear
            # layers (a weight update rewrites the panels: `refresh_from`).
            self.w13 = nn.Parameter(torch.empty(0, dtype=self.w13.dtype), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(0, dtype=self.w2.dtype), requires_grad=False)
        elif self.quantization not in (None, BF16_WEIGHTS):  # bf16 stays in the plain weights
            raise ValueError(f"--quantization {self.quantization} of MoE experts needs the CPU "
                             "kernel on float32 weights")

    def refresh_from(self, loaded: FusedMoE) -> None:
        """Take the weights of `loaded` (the same layer, just loaded, not processed) in
        place: into the packed panels, or the plain weights (a weight update)."""
        if self.packed is not None:
            self.packed.refresh(loaded.w13.data, loaded.w2.data)
        else:
            self.w13.data.copy_(loaded.w13.data)
            self.w2.data.copy_(loaded.w2.data)

    def swiglu(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's experts on rows grouped by local expert (`counts` [E_local])."""
        if self.packed is not None:
            return self.packed.forward(rows.contiguous(), counts)
        return grouped.grouped_swiglu(rows, self.w13, self.w2, counts)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each token's experts, complete (reduced over the ranks).

        Args:
            x: [T, H]; topk_weights, topk_ids: [T, k] from the router.
        """
        if self.load_counts is not None:
            self.load_counts += torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts)
        if self.ep is not None:
            return self.ep.dispatch_combine(x, topk_weights, topk_ids, self.num_experts,
                                            self._local_compute)
        if x.device.type == "cuda":
            from ringserve.gpu.moe import triton_moe

            out = triton_moe.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)
        else:
            out = grouped.combine_experts(x, topk_weights, topk_ids, self.num_experts,
                                          self.swiglu)
        return self.tp.all_reduce(out)

    def _local_compute(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids, minlength=len(self.experts))
        y = self.swiglu(rows[order], counts)
        out = torch.empty_like(y)
        out[order] = y
        return out

    def dummy_pass(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Take part in the layer's collectives with no token (an idle data-parallel rank)."""
        if self.ep is not None:
            empty = torch.empty((0, hidden_size), dtype=dtype, device=device)
            ids = torch.empty((0, 1), dtype=torch.int64, device=device)
            self.ep.dispatch_combine(empty, empty.new_empty((0, 1)), ids, self.num_experts,
                                     self._local_compute)
