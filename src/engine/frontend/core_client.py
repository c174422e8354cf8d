"""Clients of an engine core: how a frontend adds requests and receives outputs.

`EngineCoreClient` is the interface `LLMEngine` (sync) uses; `InprocClient` runs the
`EngineCore` in the caller's process and steps it on `get_output()`. The multiprocess clients
(zmq to an `EngineCoreProc`) implement the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from ringserve.config import EngineConfig
from ringserve.engine.core.engine_core import EngineCore
from ringserve.engine.wire import EngineCoreOutputs, EngineCoreRequest
from ringserve.gpu.executor.base import Executor


class EngineCoreClient(ABC):
    """What a synchronous frontend needs from an engine core."""

    num_blocks: int
    max_model_len: int

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request to the core."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests in the core (unknown ids are ignored)."""

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (empty when the core has nothing to do)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Call a utility method on the core and return its result."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the core; idempotent."""


class InprocClient(EngineCoreClient):
    """Runs the engine core in this process; `get_output` drives its steps.

    Args:
        config: the engine configuration.
        executor_class: override the executor (tests, benchmarks).
    """

    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.core = EngineCore(config, executor_class)
        self.num_blocks = self.core.num_blocks
        self.max_model_len = config.model_config.max_model_len

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        core = self.core
        while True:
            if core.batch_queue_size > 1:
                outputs, _ = core.step_with_batch_queue()
                if outputs is None:
                    continue  # a step was queued; the next call waits for the oldest
            else:
                outputs, _ = core.step()
            if outputs:
                return outputs.get(0) or EngineCoreOutputs(engine_index=core.engine_index)
            if not core.has_work():
                return EngineCoreOutputs(engine_index=core.engine_index)

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.core.call_utility(method, list(args))

    def shutdown(self) -> None:
        self.core.shutdown()
