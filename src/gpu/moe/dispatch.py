"""Expert parallelism: which rank owns which experts, and the all-to-all that sends each
(token, expert) pair to the rank owning the expert and brings the result back.

The expert-parallel (EP) group is every worker of the deployment: the TP ranks of every
data-parallel engine core (EP size = TP x DP, as vLLM's `--enable-expert-parallel`). Rank r
owns experts [r * E / N, (r + 1) * E / N) with their full intermediate size. Tokens are
replicated across the TP ranks of one engine core, so each TP rank dispatches only the tokens
t with t % tp_size == tp_rank, and the combined outputs are summed over the TP group.

One MoE layer's exchange, on the raw process-group API so the same code serves the TP group
(DP = 1) and a standalone gloo / NCCL group spanning engine cores (DP > 1): the pair counts
per destination (an all-to-all of N integers), the rows and their local expert ids, then the
expert outputs back, with the counts reversed. A rank with no token (an idle data-parallel
rank's dummy pass) sends and receives empty splits; it still takes part, so no collective
waits for it. The worker sets the group of its process once (`set_ep_group`) before the model
is built; the MoE layers read it at construction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import AllToAllOptions

from ringserve.config import ParallelConfig
from ringserve.gpu.layers.parallel import TPGroup, connect_store, gloo_group


@dataclass(frozen=True)
class EPGroup:
    """One worker's view of the expert-parallel group.

    Attributes:
        rank: this worker's EP rank (dp_rank * tp_size + tp_rank).
        world_size: EP ranks (TP x DP).
        group: the process group (raw `ProcessGroup` API: `alltoall_base`).
        tp: this worker's TP group (tokens are replicated across it).
    """

    rank: int
    world_size: int
    group: Any
    tp: TPGroup = field(default_factory=TPGroup)

    def expert_range(self, num_experts: int) -> range:
        """The global ids of the experts this rank owns.

        Raises:
            ValueError: the experts do not split evenly over the EP ranks.
        """
        if num_experts % self.world_size:
            raise ValueError(f"expert parallelism over {self.world_size} ranks needs a number "
                             f"of experts divisible by it (the model has {num_experts})")
        per = num_experts // self.world_size
        return range(self.rank * per, (self.rank + 1) * per)

    def _alltoall(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                  in_splits: list[int]) -> None:
        self.group.alltoall_base(out, inp, out_splits, in_splits, AllToAllOptions()).wait()

    def dispatch_combine(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        num_experts: int, compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The weighted expert outputs of every token of `x`, computed by the owning ranks.

        Args:
            x: [T, H] this engine core's tokens (the same on every TP rank of it).
            topk_weights, topk_ids: [T, k] routing of those tokens.
            num_experts: experts of the layer (global).
            compute: `compute(rows, local_ids)` -> [R, H]: this rank's experts applied to
                rows [R, H], `local_ids` [R] in [0, E / N), in any order.

        Returns:
            [T, H], reduced over the TP group (every TP rank returns the full sum).
        """
        n, per = self.world_size, num_experts // self.world_size
        tp = self.tp
        # (arange refuses a start past the end: a TP rank above the token count has none)
        mine = torch.arange(tp.rank, max(tp.rank, x.shape[0]), tp.world_size, device=x.device)
        ids = topk_ids[mine].reshape(-1)
        k = topk_ids.shape[1]
        order = torch.argsort(ids, stable=True)  # by expert, hence by destination rank
        sorted_ids = ids[order]
        send_counts = torch.bincount(sorted_ids // per, minlength=n)
        recv_counts = torch.empty_like(send_counts)
        self._alltoall(recv_counts, send_counts, [1] * n, [1] * n)
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        token = mine[order // k]
        rows = x[token]
        recv_rows = x.new_empty((sum(recvs), x.shape[1]))
        self._alltoall(recv_rows, rows, recvs, sends)
        recv_ids = sorted_ids.new_empty(sum(recvs))
        self._alltoall(recv_ids, sorted_ids % per, recvs, sends)
        result = compute(recv_rows, recv_ids)
        back = x.new_empty(rows.shape)
        self._alltoall(back, result.contiguous(), sends, recvs)
        back *= topk_weights[mine].reshape(-1)[order].unsqueeze(1).to(back.dtype)
        out = torch.zeros_like(x).index_add_(0, token, back)
        return tp.all_reduce(out)


_current: list[EPGroup | None] = [None]


def init_ep_group(parallel: ParallelConfig, tp: TPGroup, backend: str,
                  timeout_s: float) -> EPGroup | None:
    """This worker's EP group, or None without expert parallelism (or with one rank).

    With one engine core the EP group is the TP group itself; with several (a lockstep
    deployment) it is a standalone group of every core's workers, meeting in the frontend's
    TCPStore (`ringserve.gpu.layers.parallel.serve_store`), rank dp_rank * tp_size + tp_rank, in the
    deployment's current epoch (a retry after a fault rebuilds the group in the next one);
    its collectives give up on a silent peer after `timeout_s`.

    Raises:
        ValueError: NCCL is asked for across engine cores (not built yet).
    """
    size = parallel.expert_parallel_size
    if size == 1:
        return None
    if parallel.data_parallel_size == 1:
        return EPGroup(rank=tp.rank, world_size=tp.world_size, group=tp.group, tp=tp)
    if backend != "gloo":
        raise ValueError("expert parallelism across engine cores runs over gloo (CPU) only "
                         "so far")
    store = connect_store(parallel.data_parallel_master_port)
    epoch = int(store.get("ringserve/epoch").decode())  # see ringserve.engine.core.dp_wave
    rank = parallel.data_parallel_rank * tp.world_size + tp.rank
    return EPGroup(rank=rank, world_size=size,
                   group=gloo_group(store, f"ringserve/ep/{epoch}", rank, size, timeout_s),
                   tp=tp)


def set_ep_group(group: EPGroup | None) -> None:
    """Make `group` the EP group of this process (the worker calls this before the model is
    built; None: no expert parallelism)."""
    _current[0] = group


def ep_group() -> EPGroup | None:
    """The EP group of this process, or None without expert parallelism."""
    return _current[0]
