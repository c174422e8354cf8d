"""The executor interface the engine core drives, whatever the workers are.

An executor owns the engine core's workers: it starts them, has them load the model and size
the KV cache, runs one step on all of them (`execute_model`, blocking or returning a future),
calls a method on all of them (`collective_rpc`), and shuts them down. `max_concurrent_batches`
tells the core how many steps it may keep in flight (2 with async scheduling: step N+1 is
scheduled and queued while step N runs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, overload

from ringserve.config import EngineConfig
from ringserve.gpu.wire import GrammarOutput, ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """Base class of the executors.

    Args:
        config: the engine's configuration.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.num_blocks = 0
        self._failure_callbacks: list[Callable[[BaseException], None]] = []

    def register_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(error)` (from any thread) as soon as a worker dies between steps,
        so an idle engine core hears of it at once instead of at its next step."""
        self._failure_callbacks.append(callback)

    def _notify_failure(self, error: BaseException) -> None:
        for callback in self._failure_callbacks:
            callback(error)

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the core may keep in flight: 2 with async scheduling, else 1."""
        return 2 if self.config.scheduler_config.async_scheduling else 1

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """The number of KV cache blocks every worker can hold (the minimum over workers)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks on every worker."""

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[False] = False
    ) -> ModelRunnerOutput: ...

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[True]
    ) -> Future[ModelRunnerOutput]: ...

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step on all workers; the output rank's result (or a future of it)."""
        future = self._submit_step(scheduler_output)
        return future if non_block else future.result()

    @abstractmethod
    def _submit_step(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start one step; steps run in submission order. A step with `grammar_req_ids`
        runs its forward and completes once `sample_tokens` has brought its bitmask."""

    @abstractmethod
    def sample_tokens(self, grammar: GrammarOutput) -> None:
        """Hand a submitted step (`grammar.step_id`, which has `grammar_req_ids`) its grammar
        bitmask: the workers mask the constrained rows and sample; the step's future
        completes then."""

    def hold_steps(self, up: bool) -> bool:
        """Raise or lower the flag that makes the workers skip the steps they read
        (`ringserve.gpu.executor.step_hold`); False (nothing done) where steps are never
        skipped, as here."""
        return False

    @abstractmethod
    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), timeout: float | None = None
    ) -> list[Any]:
        """Call `method(*args)` on every worker (between steps); results in rank order.

        Raises:
            TimeoutError: not every worker answered within `timeout` seconds (None: no limit).
        """

    @abstractmethod
    def check_health(self) -> None:
        """Raise if a worker is dead or broken."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free their resources; idempotent."""
