"""Where the Ray executor's TP workers run: a Ray placement group of one bundle per rank.

`ray_executor.RayExecutor` reserves a `WorkerPlacement` before it starts any actor: a placement
group of `tensor_parallel_size` bundles, each `worker_bundle` (a GPU and a token share of a CPU
on CUDA, the CPU share alone otherwise), laid out by `placement_strategy()`: Ray's ``PACK`` by
default (as few nodes as possible, as vLLM does), or ``SPREAD`` / ``STRICT_SPREAD`` to put the
ranks on different nodes, or ``STRICT_PACK`` to keep them on one. Rank r's actor runs in bundle r
(`scheduling`). Reserving waits at most `PLACEMENT_TIMEOUT_S` and then fails with a message
that says what did not fit, instead of waiting for ever as Ray would; the executor removes the
group on shutdown (`remove`), so a rebuilt executor (a fault-tolerance ``retry``) finds the
resources free. Imports ray only inside its functions, like the executor.
"""

from __future__ import annotations

import logging
from typing import Any

from ringserve import envs

logger = logging.getLogger(__name__)

PLACEMENT_STRATEGY_ENV = "RINGSERVE_RAY_PLACEMENT_STRATEGY"
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's, all of them
DEFAULT_PLACEMENT_STRATEGY = "PACK"
# Long enough for a busy cluster to free a bundle, short enough that a fault-tolerance retry
# on a cluster that lost a node reports "no room" well inside engine_recovery_timeout_sec.
PLACEMENT_TIMEOUT_S = 60.0
ACTOR_NUM_CPUS = 0.1  # a token share, so every TP rank fits on a small node (threads: ray_worker)


def placement_strategy() -> str:
    """The placement strategy for the TP workers: ``RINGSERVE_RAY_PLACEMENT_STRATEGY``.

    Unset or empty: ``PACK``. Case-insensitive.

    Raises:
        ValueError: the value is not one of Ray's strategies.
    """
    raw = envs.ray_placement_strategy()
    if not raw.strip():
        return DEFAULT_PLACEMENT_STRATEGY
    strategy = raw.strip().upper()
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(
            f"{PLACEMENT_STRATEGY_ENV}: got {raw!r}, allowed: {', '.join(PLACEMENT_STRATEGIES)}"
        )
    return strategy


def worker_bundle(cuda: bool) -> dict[str, float]:
    """The resources one TP worker reserves (its actor asks for exactly these)."""
    return {"CPU": ACTOR_NUM_CPUS, "GPU": 1.0} if cuda else {"CPU": ACTOR_NUM_CPUS}


class WorkerPlacement:
    """A reserved placement group: bundle r is rank r's (see the module docstring).

    Args:
        group: the ready `ray.util.placement_group.PlacementGroup`.
        bundle: the resources of each bundle.
    """

    def __init__(self, group: Any, bundle: dict[str, float]) -> None:
        self.group = group
        self.bundle = bundle
        self._removed = False

    @classmethod
    def reserve(
        cls, world_size: int, bundle: dict[str, float], strategy: str,
        timeout_s: float | None = None,
    ) -> WorkerPlacement:
        """Create the group and wait until Ray has reserved every bundle.

        Args:
            world_size: the number of bundles (TP ranks).
            bundle: each bundle's resources (`worker_bundle`).
            strategy: one of `PLACEMENT_STRATEGIES`.
            timeout_s: how long to wait; `PLACEMENT_TIMEOUT_S` when None.

        Raises:
            TimeoutError: the cluster had no room in time (the group is removed again).
        """
        import ray
        from ray.util.placement_group import placement_group

        timeout = PLACEMENT_TIMEOUT_S if timeout_s is None else timeout_s
        group = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy)
        placement = cls(group, bundle)
        try:
            ready, _ = ray.wait([group.ready()], timeout=timeout)
        except BaseException:  # interrupted: nobody else holds the group to remove it
            placement.remove()
            raise
        if not ready:
            try:
                message = _no_room_message(world_size, bundle, strategy, timeout)
            finally:
                placement.remove()
            raise TimeoutError(message)
        return placement

    def scheduling(self, rank: int) -> Any:
        """The `scheduling_strategy` option that puts rank `rank`'s actor in its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=rank,
        )

    def remove(self) -> None:
        """Give the bundles back to the cluster. Idempotent.

        A removal Ray refuses (its GCS is gone) is logged: the group ends with this job anyway.
        """
        if self._removed:
            return
        self._removed = True
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.group)
        except Exception as exc:
            logger.warning("could not remove the TP workers' Ray placement group: %s", exc)


def _no_room_message(world_size: int, bundle: dict[str, float], strategy: str, timeout: float) -> str:
    import ray

    nodes = [node for node in ray.nodes() if node.get("Alive")]  # type: ignore[no-untyped-call]
    total = ray.cluster_resources()  # type: ignore[no-untyped-call]
    free = ray.available_resources()  # type: ignore[no-untyped-call]
    have = ", ".join(
        f"{name} {free.get(name, 0.0):g} free of {total.get(name, 0.0):g}" for name in bundle
    )
    per_node = {
        "STRICT_SPREAD": "each on its own node",
        "STRICT_PACK": "all on one node",
    }.get(strategy, "")
    return (
        f"the Ray cluster has no room for {world_size} workers needing {bundle} each "
        f"(placement strategy {strategy}{', ' + per_node if per_node else ''}) after "
        f"{timeout:.0f} s: {len(nodes)} alive node{'s' if len(nodes) != 1 else ''}, {have}; "
        f"add nodes or free resources, or choose another {PLACEMENT_STRATEGY_ENV} "
        f"({', '.join(PLACEMENT_STRATEGIES)})"
    )
