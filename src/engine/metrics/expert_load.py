"""Expert load of mixture-of-experts models (behind --enable-expert-load-metrics).

Who counts: the model runner of TP rank 0 gives every `FusedMoE` layer a [num_experts] int64
tensor (`FusedMoE.load_counts`) that its forward adds each token's top-k routings to, on the
device, with no host sync (`ModelRunner.enable_expert_load`). The counts are cumulative since
the workers started, and survive a reload of the weights (sleep level 2 / wake up).

Who pulls: the engine core, between steps, with `collective_rpc("get_expert_load")` (a plain
list of lists of ints), only when an `ExpertLoadPuller` says one is due: at most once per
`--log-stats-interval`, plus once when the core runs out of requests (so an offline
`LLM.get_metrics()` after `generate()` sees every token). The puller turns the cumulative
counts into the delta since its previous pull, which travels in `SchedulerStats.expert_load`
(per sparse layer, in layer order, per expert). New workers (after a fault) start from zero.

Who publishes: the frontend's `PrometheusStatLogger` adds the deltas to
`ringserve:moe_expert_load_tokens_total{layer, expert}` (`layer` is the decoder layer index,
read from the config by `expert_load_shape`, as the core and the workers read it), and the
log line shows the worst layer's max / mean expert load (`imbalance`). Plain Python.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ringserve.config import EngineConfig
from ringserve.moe_shape import MoeShape, moe_shape

if TYPE_CHECKING:
    from ringserve.engine.wire import EngineCoreOutputs

logger = logging.getLogger(__name__)

# The worker method that returns the cumulative counts (`Worker.get_expert_load`).
WORKER_METHOD = "get_expert_load"


def expert_load_shape(config: EngineConfig) -> MoeShape | None:
    """The experts whose load is recorded: the model's, when --enable-expert-load-metrics is
    on (and stats are) and the model has sparse layers; None otherwise."""
    if not config.observability_config.record_expert_load:
        return None
    shape = moe_shape(config.model_config)
    return shape if shape is not None and shape.sparse_layers else None


class ExpertLoadPuller:
    """When the engine core pulls the workers' counts, and the delta since the last pull.

    Args:
        shape: the model's experts (the layout of every reply).
        interval: seconds between pulls while requests run (`--log-stats-interval`).
        now: the monotonic time the engine started.
    """

    def __init__(self, shape: MoeShape, interval: float, now: float) -> None:
        self.num_layers = len(shape.sparse_layers)
        self.num_experts = shape.num_experts
        self.interval = interval
        self._next_pull = now + interval
        self._source: object | None = None  # the executor whose workers `_last` came from
        self._last: list[list[int]] = self._zeros()
        self._last_step = -1

    @classmethod
    def for_config(cls, config: EngineConfig, now: float) -> ExpertLoadPuller | None:
        """A puller when expert load is recorded for `config` (see `expert_load_shape`)."""
        shape = expert_load_shape(config)
        if shape is None:
            if config.observability_config.record_expert_load:
                logger.warning("--enable-expert-load-metrics: %s has no mixture-of-experts "
                               "layer; no expert load is recorded",
                               config.model_config.architecture)
            return None
        return cls(shape, config.observability_config.log_stats_interval, now)

    def _zeros(self) -> list[list[int]]:
        return [[0] * self.num_experts for _ in range(self.num_layers)]

    def due(self, source: object, step_counter: int, idle: bool, now: float) -> bool:
        """Whether to pull after the step numbered `step_counter` (the scheduler's): once the
        interval has passed, or when the core has no request left (`idle`), unless nothing
        was scheduled since the previous pull from the same workers (`source`)."""
        if source is self._source and step_counter == self._last_step:
            return False
        return idle or now >= self._next_pull

    def add_to(self, batches: Iterable[EngineCoreOutputs], source: object, idle: bool,
               pull: Callable[[], list[list[int]]]) -> None:
        """After a step: when a pull is due (`due`), call `pull` (rank 0's cumulative counts;
        it waits for the steps still in flight) and put the load since the previous pull
        into the step's stats.

        Raises:
            WorkerTimeoutError, ExecutorError: from `pull` (an engine fault).
        """
        stats = next((b.scheduler_stats for b in batches if b.scheduler_stats is not None), None)
        if stats is None:
            return
        now = time.monotonic()
        if self.due(source, stats.step_counter, idle, now):
            stats.expert_load = self.take(source, pull(), stats.step_counter, now)

    def take(self, source: object, cumulative: list[list[int]], step_counter: int,
             now: float) -> list[list[int]] | None:
        """The load since the previous pull, from the workers' cumulative counts.

        Args:
            source: the executor the counts came from (new workers count from zero).
            cumulative: rank 0's reply; empty when its workers record nothing (the null
                executor), which gives None.
            step_counter: the scheduler's step counter at the pull.
            now: the monotonic time of the pull.

        Raises:
            ValueError: the reply's layout differs from the config's (a bug).
        """
        self._next_pull = now + self.interval
        self._last_step = step_counter
        if not cumulative:
            return None
        if len(cumulative) != self.num_layers or any(len(row) != self.num_experts
                                                     for row in cumulative):
            raise ValueError(f"expert load: the workers sent {len(cumulative)} layers of "
                             f"{[len(row) for row in cumulative]} experts; the config has "
                             f"{self.num_layers} sparse layers of {self.num_experts} experts")
        if source is not self._source:
            self._source, self._last = source, self._zeros()
        delta = [[int(c) - p for c, p in zip(row, last, strict=True)]
                 for row, last in zip(cumulative, self._last, strict=True)]
        self._last = [[int(c) for c in row] for row in cumulative]
        return delta


def imbalance(load: list[list[int]]) -> tuple[float, int] | None:
    """The most unbalanced layer of `load` (per layer, per expert): (its max / mean expert
    load, its position in `load`); None when no token was routed."""
    worst: tuple[float, int] | None = None
    for position, row in enumerate(load):
        total = sum(row)
        if total <= 0:
            continue
        ratio = max(row) * len(row) / total
        if worst is None or ratio > worst[0]:
            worst = (ratio, position)
    return worst
