"""The in-process executor: one worker inside the engine-core process.

Steps run on one dedicated thread, in submission order, so the core's busy loop can schedule
step N+1 while step N computes (torch releases the GIL inside its kernels). Utility calls
(`collective_rpc`) go through the same thread, so they never race a step. A step the thread
starts while a pause holds the steps (`hold_steps`) is skipped (`step_hold.py`).
"""

from __future__ import annotations

import ctypes
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ringserve.config import EngineConfig
from ringserve.gpu.executor.base import Executor
from ringserve.gpu.executor.step_hold import steps_may_be_skipped
from ringserve.gpu.wire import GrammarOutput, ModelRunnerOutput, SchedulerOutput


class UniProcExecutor(Executor):
    """Runs a single `Worker` (rank 0, no torch.distributed) in this process."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        from ringserve.gpu.worker import Worker

        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringserve-step")
        # Steps whose forward was submitted and that wait for their grammar bitmask.
        self._awaiting_grammar: dict[int, tuple[Future[Any], Future[ModelRunnerOutput]]] = {}
        self._may_skip = steps_may_be_skipped(config)
        # The step-hold byte: read by the step thread as each step starts, and by the
        # captured decode step between its layers.
        self._hold = ctypes.c_ubyte(0)
        self.worker = Worker(config, rank=0, local_rank=0)
        self._call("init_device")
        self._call("load_model")
        if self._may_skip:
            self.worker.set_abort_flag(ctypes.addressof(self._hold))

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return self._thread.submit(getattr(self.worker, method), *args).result(timeout)

    def determine_num_blocks(self) -> int:
        return int(self._call("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call("initialize_kv_cache", num_blocks)
        self.num_blocks = num_blocks

    def hold_steps(self, up: bool) -> bool:
        if not self._may_skip:
            return False
        self._hold.value = 1 if up else 0
        return True

    def _step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        if self._hold.value:
            return self.worker.skip_step(scheduler_output)
        return self.worker.execute_model(scheduler_output)

    def _submit_step(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        forward = self._thread.submit(self._step, scheduler_output)
        if not scheduler_output.grammar_req_ids:
            return forward  # type: ignore[return-value]  # not None without grammar rows
        result: Future[ModelRunnerOutput] = Future()
        self._awaiting_grammar[scheduler_output.step_id] = (forward, result)
        return result

    def sample_tokens(self, grammar: GrammarOutput) -> None:
        forward, result = self._awaiting_grammar.pop(grammar.step_id)

        def sample() -> ModelRunnerOutput:
            skipped = forward.result()  # the forward's error, if it failed
            if skipped is not None:
                return skipped  # type: ignore[no-any-return]  # the step was skipped
            output = self.worker.sample_tokens(grammar)
            assert output is not None  # only the bitmask of a skipped step gives None
            return output

        _chain(self._thread.submit(sample), result)

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), timeout: float | None = None
    ) -> list[Any]:
        return [self._call(method, *args, timeout=timeout)]

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


def _chain(source: Future[ModelRunnerOutput], target: Future[ModelRunnerOutput]) -> None:
    """Complete `target` with `source`'s result or error."""

    def done(f: Future[ModelRunnerOutput]) -> None:
        if f.cancelled():  # the executor shut down with the step queued
            target.cancel()
            return
        error = f.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(f.result())

    source.add_done_callback(done)
