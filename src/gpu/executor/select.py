"""Choosing the executor class for an engine's `distributed_executor_backend`.

Above the executors (each imports `base`), so that `base` names none of them; the engine core
calls `executor_class` once, at start-up.
"""

from __future__ import annotations

from ringserve.config import EngineConfig
from ringserve.gpu.executor.base import Executor


def executor_class(config: EngineConfig) -> type[Executor]:
    """The executor class for `parallel_config.distributed_executor_backend`.

    Raises:
        ValueError: the backend is none of uni, mp, ray.
    """
    backend = config.parallel_config.distributed_executor_backend
    if backend == "uni":
        from ringserve.gpu.executor.uniproc import UniProcExecutor

        return UniProcExecutor
    if backend == "mp":
        from ringserve.gpu.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        # Imported only when chosen: Ray is an optional dependency.
        from ringserve.gpu.executor.ray_executor import RayExecutor

        return RayExecutor
    raise ValueError(f"distributed_executor_backend {backend!r} is unknown; use uni, mp or ray")
