"""A null model: steps return at once with made-up tokens.

Measures the engine's own overhead (schedule, IPC, update, output) without a model, as the
throughput benchmark's engine-overhead run needs, and drives engine tests that only care about
scheduling. `NullModel` keeps just enough per-request state to know when a prompt is fully
computed and "samples" a deterministic token from the request id and position (never an id
below `first_token_id`, so never an EOS of the tiny models). It runs in process
(`NullExecutor`) or inside the mp executor's worker processes (`NullWorker` through
`NullMultiprocExecutor`), so the null-model runs can include the rings.
"""

from __future__ import annotations

import time
import zlib
from concurrent.futures import Future
from typing import Any

import numpy as np

from ringserve.config import EngineConfig
from ringserve.gpu.executor.base import Executor
from ringserve.gpu.executor.multiproc import MultiprocExecutor
from ringserve.gpu.wire import GrammarOutput, ModelRunnerOutput, SchedulerOutput

DEFAULT_NUM_BLOCKS = 4096
FIRST_TOKEN_ID = 16


class NullModel:
    """The step logic: one token for each request whose prompt is now computed."""

    def __init__(self, vocab_size: int) -> None:
        self._num_tokens: dict[str, int] = {}  # request id -> prompt + output tokens known
        self._seed: dict[str, int] = {}
        self._span = max(1, vocab_size - FIRST_TOKEN_ID)
        self._vocab_size = vocab_size
        self.steps = 0

    def run_step(self, so: SchedulerOutput, grammar: GrammarOutput | None = None,
                 ) -> ModelRunnerOutput:
        """The step's output; a constrained row takes the first token its bitmask allows at
        or after the made-up one (cyclically), so constrained output is valid."""
        self.steps += 1
        for rid in so.finished_req_ids:
            self._num_tokens.pop(rid, None)
            self._seed.pop(rid, None)
        for rid in so.preempted_req_ids:
            self._num_tokens.pop(rid, None)
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self._num_tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self._seed[new.req_id] = zlib.crc32(new.req_id.encode())
            computed[new.req_id] = new.num_computed_tokens
        for cached in so.scheduled_cached_reqs:
            if cached.resumed_from_preemption:
                self._num_tokens[cached.req_id] = len(cached.all_token_ids)
            computed[cached.req_id] = cached.num_computed_tokens
        req_ids = list(so.num_scheduled_tokens)
        masks = {} if grammar is None else dict(zip(grammar.req_ids, grammar.bitmask,
                                                    strict=True))
        sampled: list[list[int]] = []
        for rid in req_ids:
            known = self._num_tokens.get(rid, 0)
            if computed.get(rid, 0) + so.num_scheduled_tokens[rid] >= known:
                token = FIRST_TOKEN_ID + (self._seed.get(rid, 0) + 31 * known) % self._span
                if rid in masks:
                    token = _allowed_from(masks[rid], token, self._vocab_size)
                self._num_tokens[rid] = known + 1
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(step_id=so.step_id, req_ids=req_ids, sampled_token_ids=sampled)

    def clear(self) -> None:
        """Forget every request."""
        self._num_tokens.clear()
        self._seed.clear()


def _allowed_from(bitmask_row: np.ndarray[Any, Any], token: int, vocab_size: int) -> int:
    """The first token at or after `token` (wrapping) whose bit is set; `token` if none."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask_row, dtype=np.int32).view(np.uint8),
                         bitorder="little")[:vocab_size]
    allowed = np.flatnonzero(bits)
    if allowed.size == 0:
        return token
    after = allowed[allowed >= token]
    return int(after[0] if after.size else allowed[0])


class NullExecutor(Executor):
    """Answers every step immediately (or after `step_s`), in process.

    Args:
        config: the engine config (`num_gpu_blocks_override` sets the block count).
        step_s: seconds each step takes (a fixed step time for frontend-bound benchmarks:
            `RINGSERVE_NULL_STEP_MS`).
    """

    def __init__(self, config: EngineConfig, step_s: float = 0.0) -> None:
        super().__init__(config)
        self.model = NullModel(config.model_config.vocab_size)
        self.step_s = step_s
        self._awaiting_grammar: dict[int, tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = {}

    def determine_num_blocks(self) -> int:
        return self.config.cache_config.num_gpu_blocks_override or DEFAULT_NUM_BLOCKS

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def _submit_step(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        future: Future[ModelRunnerOutput] = Future()
        if self.step_s:
            time.sleep(self.step_s)
        if scheduler_output.grammar_req_ids:
            self._awaiting_grammar[scheduler_output.step_id] = (scheduler_output, future)
        else:
            future.set_result(self.model.run_step(scheduler_output))
        return future

    def sample_tokens(self, grammar: GrammarOutput) -> None:
        scheduler_output, future = self._awaiting_grammar.pop(grammar.step_id)
        future.set_result(self.model.run_step(scheduler_output, grammar))

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), timeout: float | None = None
    ) -> list[Any]:
        if method in ("sleep", "wake_up"):  # nothing to free or restore
            return [None]
        if method == "get_expert_load":  # no experts, nothing counted
            return [[]]
        raise ValueError(f"the null executor has no workers to call {method!r} on")

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self.model.clear()


class NullWorker:
    """The `Worker` interface over a `NullModel` (runs in an mp worker process)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model = NullModel(config.model_config.vocab_size)
        self._awaiting: SchedulerOutput | None = None

    def init_device(self) -> None:
        """Nothing to select."""

    def load_model(self) -> None:
        """Nothing to load."""

    def determine_num_blocks(self) -> int:
        """`num_gpu_blocks_override`, else DEFAULT_NUM_BLOCKS."""
        return self.config.cache_config.num_gpu_blocks_override or DEFAULT_NUM_BLOCKS

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Nothing to allocate."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The null step (None when it waits for its grammar)."""
        if scheduler_output.grammar_req_ids:
            self._awaiting = scheduler_output
            return None
        return self.model.run_step(scheduler_output)

    def sample_tokens(self, grammar: GrammarOutput) -> ModelRunnerOutput:
        """The null step that waited for its grammar."""
        scheduler_output, self._awaiting = self._awaiting, None
        if scheduler_output is None or scheduler_output.step_id != grammar.step_id:
            raise ValueError(f"sample_tokens: no step {grammar.step_id} waits for a grammar")
        return self.model.run_step(scheduler_output, grammar)

    def sleep(self, level: int) -> None:
        """Nothing to free."""

    def wake_up(self) -> None:
        """Nothing to restore."""

    def get_expert_load(self) -> list[list[int]]:
        """No experts: nothing counted."""
        return []


class NullMultiprocExecutor(MultiprocExecutor):
    """The mp executor with `NullWorker`s: the rings and processes, without a model."""

    null_model = True
