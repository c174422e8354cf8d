"""The part the `mp` and `ray` executors share: futures for steps and RPCs sent to N ranks.

Both executors keep their workers in other processes, send every step and RPC to all ranks
through one transport (a broadcast ring, or zmq sockets) under one lock, and complete the
futures from reader threads through `Pending`. They differ only in how a message is sent
(`_send`) and in how a worker's death is noticed (`_poll_deaths`).
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from concurrent.futures import Future
from typing import Any

from ringserve.config import EngineConfig
from ringserve.gpu.executor.base import Executor
from ringserve.gpu.executor.errors import WorkerDiedError
from ringserve.gpu.executor.pending import Pending
from ringserve.gpu.executor.wire import FrameKind, RpcRequest
from ringserve.gpu.wire import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from ringserve.serial import MsgpackEncoder


class RemoteWorkersExecutor(Executor):
    """An executor whose `tensor_parallel_size` workers answer through `Pending`.

    Args:
        config: the engine configuration.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.world_size = config.parallel_config.tensor_parallel_size
        self._pending = Pending(self.world_size)
        self._send_lock = threading.Lock()  # one sender on the transport at a time
        self._encoder = MsgpackEncoder()

    @abstractmethod
    def _send(self, kind: FrameKind, message: Any) -> None:
        """Send one message to every rank (the caller holds `_send_lock`).

        Raises:
            WorkerDiedError: a rank is known to be gone (the pending work fails with it).
        """

    def _poll_deaths(self) -> None:
        """Record, in `_pending`, a worker death not reported yet (default: none to poll)."""

    def determine_num_blocks(self) -> int:
        """The minimum over ranks of the KV blocks each can hold."""
        return min(int(n) for n in self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks on every rank."""
        self.collective_rpc("initialize_kv_cache", (num_blocks,))
        self.num_blocks = num_blocks

    def _submit_step(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        with self._send_lock:
            future = self._pending.add_step(scheduler_output.step_id)
            if future.done():
                return future  # already failed: the executor is broken
            try:
                self._send(FrameKind.STEP, scheduler_output)
            except WorkerDiedError as exc:
                self._pending.fail(exc)
            except BaseException:
                self._pending.drop_last_step(future)
                raise
        return future

    def sample_tokens(self, grammar: GrammarOutput) -> None:
        """Broadcast the step's bitmask (a GRAMMAR frame); rank 0 answers the step then."""
        with self._send_lock:
            try:
                self._send(FrameKind.GRAMMAR, grammar)
            except WorkerDiedError as exc:
                self._pending.fail(exc)

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), timeout: float | None = None
    ) -> list[Any]:
        """Call `Worker.<method>(*args)` on every rank; the values in rank order.

        Arguments and values cross as msgpack (numbers, strings, lists, dicts, numpy arrays,
        tensors); msgspec Structs come back as their array or dict form.

        Raises:
            WorkerError: a rank raised (the message names the rank and carries its error).
            WorkerDiedError: a worker died before every rank answered.
            TimeoutError: not every rank answered within `timeout` seconds.
        """
        with self._send_lock:
            call_id, future = self._pending.add_call()
            if not future.done():
                try:
                    self._send(FrameKind.RPC, RpcRequest(call_id, method, tuple(args)))
                except WorkerDiedError as exc:
                    self._pending.fail(exc)
                except BaseException:
                    self._pending.drop_call(call_id)
                    raise
        try:
            return future.result(timeout)
        except TimeoutError:
            self._pending.drop_call(call_id)
            raise

    def check_health(self) -> None:
        """Raise the first fault (a worker died or raised), if any.

        Raises:
            WorkerDiedError, WorkerError, ExecutorShutdownError: the executor cannot run steps.
        """
        self._poll_deaths()
        if self._pending.failure is not None:
            raise self._pending.failure
