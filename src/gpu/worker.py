"""The worker: one device (or the CPU), one TP rank; the engine core's executor drives it.

Lifecycle, called in this order by the executor:
`Worker(config, rank=...)` -> `init_device()` -> `load_model()` -> `determine_num_blocks()`
(every rank; the executor takes the minimum and tells the scheduler) ->
`initialize_kv_cache(num_blocks)` -> `execute_model(scheduler_output)` per step.

KV cache sizing: `num_gpu_blocks_override` wins; otherwise `kv_cache_memory` bytes when given;
otherwise on CUDA a maximum-size dummy forward is profiled and the cache gets
`gpu_memory_utilization` of total memory minus the measured peak; on CPU without a size the
cache gets `DEFAULT_CPU_KV_CACHE_BYTES`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ringserve.config import EngineConfig
from ringserve.gpu.attention.backend import BackendName
from ringserve.gpu.layers.parallel import TPGroup, init_tp_group
from ringserve.gpu.moe.dispatch import init_ep_group, set_ep_group
from ringserve.gpu.pooling.encoder_runner import EncoderRunner
from ringserve.gpu.runner.input_prep import prepare_inputs
from ringserve.gpu.runner.model_runner import ModelRunner
from ringserve.gpu.weights.update import WeightUpdateError, WeightUpdater, weight_checksum
from ringserve.gpu.wire import GrammarOutput, ModelRunnerOutput, NewRequestData, SchedulerOutput
from ringserve.sampling_params import SamplingParams

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


class Worker:
    """Owns one device, its model runner and its KV cache.

    Args:
        config: the engine configuration.
        rank: this worker's TP rank.
        local_rank: the CUDA device index on this host.
        distributed_init_method: torch.distributed init URL (needed when TP > 1).
        attention_backend: "auto", "torch", "cpu" or "triton".
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str = "tcp://127.0.0.1:29511",
        attention_backend: BackendName = "auto",
    ) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.attention_backend: BackendName = attention_backend
        self.device = torch.device("cpu")
        self.tp = TPGroup()
        self._runner: ModelRunner | None = None
        self._abort_flag = 0  # `set_abort_flag`, handed to the runner once it exists
        self._num_blocks = 0
        self._sleep_level = 0
        self._updater: WeightUpdater | None = None

    @property
    def runner(self) -> ModelRunner:
        """The model runner (after `load_model`).

        Raises:
            RuntimeError: `load_model` has not run.
        """
        if self._runner is None:
            raise RuntimeError("Worker.load_model() must run first")
        return self._runner

    def init_device(self) -> None:
        """Select the device and join the TP group (gloo on CPU, nccl on CUDA)."""
        if self.config.device_config.device == "cuda":
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.tp = init_tp_group(
            self.rank, self.config.parallel_config.tensor_parallel_size,
            backend=backend, init_method=self.distributed_init_method,
        )
        timeout = self.config.fault_tolerance_config.execute_model_timeout_s or 60.0
        set_ep_group(init_ep_group(self.config.parallel_config, self.tp, backend, timeout))

    def dummy_pass(self) -> None:
        """Take part in the MoE layers' expert-parallel exchanges with no token (this core has
        nothing to run while another core of a lockstep deployment does)."""
        self.runner.dummy_pass()

    def load_model(self) -> None:
        """Build the runner and load the weights onto the device."""
        pooler = self.config.pooler_config
        # An encoder (pooling only, no KV cache) has a runner of its own.
        cls = EncoderRunner if pooler is not None and pooler.encoder else ModelRunner
        self._runner = cls(self.config, self.device, self.tp, self.attention_backend)
        self._runner.abort_flag = self._abort_flag
        self._runner.load_model()

    def determine_num_blocks(self) -> int:
        """The number of KV blocks this rank can hold (see the module docstring).

        Raises:
            ValueError: the memory left for the KV cache holds no block.
        """
        cache = self.config.cache_config
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_block = self.runner.kv_bytes_per_block  # a draft model's KV included
        if per_block == 0:
            # No KV cache (an encoder): the blocks are the scheduler's bookkeeping only,
            # enough for every sequence at full length.
            sched = self.config.scheduler_config
            per_seq = -(-self.config.model_config.max_model_len // cache.block_size)
            return sched.max_num_seqs * per_seq + 1
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._profile_free_bytes()
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        blocks = max(0, budget // per_block)
        if blocks < 1:
            raise ValueError(
                f"the KV cache gets {budget} bytes but one block needs {per_block}; "
                "raise kv_cache_memory / gpu_memory_utilization or lower max_num_batched_tokens"
            )
        return blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache (the same `num_blocks` on every rank)."""
        self.runner.initialize_kv_cache(num_blocks)
        self._num_blocks = num_blocks
        self.runner.enable_expert_load()  # serving starts: the profiling forward is done

    def sleep(self, level: int) -> None:
        """Free device memory while idle: level 1 the KV cache, level 2 also the weights.

        The engine core calls this only with no request in flight; `wake_up` restores.

        Raises:
            ValueError: a level other than 1 or 2.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level: got {level!r}, allowed: 1 (KV cache) or 2 (+ weights)")
        self.runner.release_kv_cache()
        if level == 2:
            self.runner.release_model()
            if self._updater is not None:
                self._updater.release_staging()
        self._sleep_level = max(self._sleep_level, level)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, weights_path: str | None = None) -> None:
        """Undo `sleep`: reload the weights (level 2: from `weights_path`, a safetensors
        directory, when given: the last weights a trainer sent) and reallocate the KV cache."""
        if self._sleep_level == 2:
            self.runner.load_model(weights_path)
        if self._sleep_level:
            self.runner.initialize_kv_cache(self._num_blocks)
        self._sleep_level = 0

    @property
    def sleep_level(self) -> int:
        """0 awake, 1 without KV cache, 2 without KV cache and weights."""
        return self._sleep_level

    # -- weights from a trainer (ringserve.gpu.weights.update) --------------------------------
    # Each returns [error or None, value]: a refused or failed update is the caller's error,
    # not an engine fault (a raising worker method is one), and leaves the old weights serving.

    @property
    def updater(self) -> WeightUpdater:
        """The weight-update state (made on first use)."""
        if self._updater is None:
            runner = self.runner
            self._updater = WeightUpdater(self.config, self.tp, self.device, runner.backend,
                                          lambda: self.runner.model, runner.swap_model,
                                          runner.capture_decode)
        return self._updater

    def init_weight_transfer_engine(self, init_info: dict[str, Any], worker_index: int,
                                    num_workers: int) -> list[Any]:
        """Open the transport to the trainer (`WeightUpdater.init`)."""
        return _guard(lambda: self.updater.init(init_info, worker_index, num_workers))

    def start_weight_update(self, metadata: dict[str, Any] | None,
                            snapshot: str | None = None) -> list[Any]:
        """Begin a round (`WeightUpdater.start`)."""
        if self._sleep_level == 2:
            return [f"{WeightUpdateError.__name__}: the weights are released (sleep level 2); "
                    "wake_up first", None]
        return _guard(lambda: self.updater.start(metadata, snapshot))

    def update_weights(self, update_info: dict[str, Any]) -> list[Any]:
        """Receive and load one bucket (`WeightUpdater.update`); value: tensors loaded."""
        return _guard(lambda: self.updater.update(update_info))

    def finish_weight_update(self) -> list[Any]:
        """Swap the round's weights in (`WeightUpdater.finish`); value: tensors loaded."""
        return _guard(self.updater.finish)

    def abort_weight_update(self) -> None:
        """Abandon the open round, if any."""
        if self._updater is not None:
            self._updater.abort()

    # -- read-only calls open to `collective_rpc` (ringserve.engine.core.weight_sync) ----------------

    def get_weight_checksum(self) -> str:
        """SHA-256 over this rank's serving weights as the kernels read them (panels,
        packed or plain tensors, in module order): equal on two ranks or two engines exactly
        when they serve the same weights in the same layout."""
        return weight_checksum(self.runner.model)

    def get_device_info(self) -> dict[str, Any]:
        """This worker's rank, device, dtype, sleep level and decode-capture state."""
        runner = self.runner
        return {"rank": self.rank, "world_size": self.tp.world_size, "device": str(self.device),
                "dtype": str(self.config.model_config.dtype).removeprefix("torch."),
                "sleep_level": self._sleep_level, "decode_capture": runner.capture is not None,
                "decode_capture_reason": runner.capture_reason}

    def remove_lora(self, identity: str) -> None:
        """Drop an unloaded LoRA adapter (`LoRAManager.remove`); nothing when LoRA is off."""
        if self.runner.lora is not None:
            self.runner.lora.remove(identity)

    def get_expert_load(self) -> list[list[int]]:
        """Tokens routed to each expert since serving started, per MoE layer (in layer
        order) and expert, with --enable-expert-load-metrics; empty on ranks other than 0
        and when off (`ringserve.engine.metrics.expert_load`)."""
        return self.runner.expert_load()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step; per-request failures are in `request_errors` afterwards. None when
        the step waits for its grammar (`sample_tokens`)."""
        return self.runner.execute_model(scheduler_output)

    def skip_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply a step's bookkeeping without running it (`ModelRunner.skip_step`)."""
        return self.runner.skip_step(scheduler_output)

    def set_abort_flag(self, address: int) -> None:
        """The step-hold byte the captured decode step reads between layers (its address
        in this process; `ModelRunner.abort_flag`)."""
        self._abort_flag = address
        if self._runner is not None:
            self._runner.abort_flag = address

    def sample_tokens(self, grammar: GrammarOutput) -> ModelRunnerOutput | None:
        """Sample the step waiting for its grammar bitmask (None: that step was skipped
        or ended early, `ModelRunner.sample_tokens`)."""
        return self.runner.sample_tokens(grammar)

    @property
    def request_errors(self) -> dict[str, str]:
        """Request id -> message for requests that failed in the last step."""
        return self.runner.request_errors

    @torch.inference_mode()
    def _profile_free_bytes(self) -> int:
        runner = self.runner
        sched = self.config.scheduler_config
        num_tokens = sched.max_num_batched_tokens
        max_len = self.config.model_config.max_model_len
        num_seqs = min(sched.max_num_seqs, num_tokens)
        lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)
        lens[: num_tokens % num_seqs] += 1
        lens = np.minimum(lens, max_len)
        bs = runner.kv_spec.block_size
        blocks_needed = int((-(-lens // bs)).sum())
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        runner.initialize_kv_cache(blocks_needed)
        next_block = 0
        for i, n in enumerate(lens.tolist()):
            nb = -(-n // bs)
            runner.table.apply_new(NewRequestData(
                f"__profile{i}", [0] * n, SamplingParams(temperature=0.0),
                list(range(next_block, next_block + nb)), 0,
            ))
            next_block += nb
        ids = [f"__profile{i}" for i in range(len(lens))]
        inputs = prepare_inputs(runner.table, ids, lens.astype(np.int32), self.device)
        hidden = runner.model.forward(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
        runner.model.compute_logits(hidden[inputs.logits_indices]).float().softmax(-1)
        torch.cuda.synchronize(self.device)
        for req_id in ids:
            runner.table.finish(req_id)
        kv_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
        runner.kv_caches = []
        peak = torch.cuda.max_memory_allocated(self.device) - kv_bytes
        total = torch.cuda.mem_get_info(self.device)[1]
        return int(total * self.config.cache_config.gpu_memory_utilization) - peak


def _guard(call: Callable[[], Any]) -> list[Any]:
    """[None, value] of `call()`, or ["Type: message", None] when it refused the update
    (`WeightUpdateError`: the old weights serve on). Anything else raises: an engine fault."""
    try:
        return [None, call()]
    except WeightUpdateError as exc:
        return [f"{type(exc).__name__}: {exc}", None]
