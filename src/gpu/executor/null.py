"""A null-model executor: steps return at once with made-up tokens.

Measures the engine's own overhead (schedule, IPC, update, output) without a model, as the
throughput benchmark's engine-overhead run needs, and drives engine tests that only care about
scheduling. It keeps just enough per-request state to know when a prompt is fully computed,
and "samples" a deterministic token from the request id and position (never an EOS id below
`first_token_id`).
"""

from __future__ import annotations

import zlib
from concurrent.futures import Future
from typing import Any

from ringserve.config import EngineConfig
from ringserve.gpu.executor.base import Executor
from ringserve.gpu.wire import ModelRunnerOutput, SchedulerOutput

DEFAULT_NUM_BLOCKS = 4096


class NullExecutor(Executor):
    """Answers every step immediately; tokens are a hash of (request id, position).

    Args:
        config: the engine config (`num_gpu_blocks_override` sets the block count).
    """

    first_token_id = 16

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._num_tokens: dict[str, int] = {}  # request id -> prompt + output tokens known
        self._seed: dict[str, int] = {}
        self.steps = 0

    def determine_num_blocks(self) -> int:
        return self.config.cache_config.num_gpu_blocks_override or DEFAULT_NUM_BLOCKS

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def _submit_step(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(self.run_step(scheduler_output))
        return future

    def run_step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """The step's output: one token for each request whose prompt is now computed."""
        self.steps += 1
        for rid in so.finished_req_ids:
            self._num_tokens.pop(rid, None)
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
        vocab = self.config.model_config.vocab_size
        span = max(1, vocab - self.first_token_id)
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            known = self._num_tokens.get(rid, 0)
            if computed.get(rid, 0) + so.num_scheduled_tokens[rid] >= known:
                token = self.first_token_id + (self._seed.get(rid, 0) + 31 * known) % span
                self._num_tokens[rid] = known + 1
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(step_id=so.step_id, req_ids=req_ids, sampled_token_ids=sampled)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        raise ValueError(f"the null executor has no workers to call {method!r} on")

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self._num_tokens.clear()
