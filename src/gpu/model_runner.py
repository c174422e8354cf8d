"""The model runner: one step from a SchedulerOutput to a ModelRunnerOutput on one device.

Owns the loaded model, the KV cache tensors, the persistent request table and the sampler, and
wires the small modules together (MRV2-style): apply the step's diff to the table
(`ringserve.gpu.request_state`), build the flat batch (`ringserve.gpu.input_prep`), run the
model, compute prompt logprobs (`ringserve.gpu.prompt_logprobs`), gather sampling metadata
(`ringserve.gpu.sampling_metadata`) and sample (`ringserve.gpu.sampler`). The worker
(`ringserve.gpu.worker`) owns the runner; tests drive it directly with hand-built schedules.

Per-request failures do not raise: a new request that does not validate is left out of the
batch (absent from `req_ids`), a request whose logits hold a NaN gets an empty sampled list, and
both get a message in `request_errors` for this step; the rest of the batch goes on.
"""

from __future__ import annotations

import numpy as np
import torch

from ringserve.config import EngineConfig
from ringserve.gpu.attention.backend import BackendName, select_backend
from ringserve.gpu.bad_words import bad_words_encoder
from ringserve.gpu.input_prep import StepInputs, prepare_inputs
from ringserve.gpu.kv_cache import KVCacheSpec, allocate_kv_cache
from ringserve.gpu.loader import load_model
from ringserve.gpu.logprobs import select_rows
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.parallel import TPGroup
from ringserve.gpu.prompt_logprobs import compute_prompt_logprobs
from ringserve.gpu.request_state import RequestTable
from ringserve.gpu.sampler import Sampler
from ringserve.gpu.sampling_metadata import build_sampling_metadata
from ringserve.gpu.validation import validate_request
from ringserve.gpu.wire import ModelRunnerOutput, SchedulerOutput


class ModelRunner:
    """Executes scheduled steps of the model on `device`.

    Args:
        config: the engine configuration.
        device: the device to run on.
        tp: this rank's tensor-parallel group.
        attention_backend: "auto" (Triton on CUDA; on CPU the C kernel, else torch), "torch",
            "cpu" or "triton".
    """

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        tp: TPGroup | None = None,
        attention_backend: BackendName = "auto",
    ) -> None:
        self.config = config
        self.model_config = config.model_config
        self.device = device
        self.tp = tp or TPGroup()
        self.backend = select_backend(device, attention_backend)
        self.kv_spec = KVCacheSpec.from_config(
            config.model_config, config.cache_config, self.tp.world_size
        )
        self.table = self._new_table()
        self.sampler = Sampler()
        self._model: LlamaForCausalLM | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.request_errors: dict[str, str] = {}

    def _new_table(self) -> RequestTable:
        config = self.config
        return RequestTable(
            max_num_reqs=config.scheduler_config.max_num_seqs,
            max_model_len=config.model_config.max_model_len,
            block_size=config.cache_config.block_size,
            eos_token_ids=config.model_config.eos_token_ids,
            device=self.device,
            tokenize=bad_words_encoder(config.model_config.tokenizer),
        )

    @property
    def model(self) -> LlamaForCausalLM:
        """The loaded model.

        Raises:
            RuntimeError: `load_model` has not run.
        """
        if self._model is None:
            raise RuntimeError("ModelRunner.load_model() must run before the model is used")
        return self._model

    def load_model(self) -> None:
        """Build the model and load its weights (see `ringserve.gpu.loader`)."""
        self._model = load_model(
            self.model_config, tp=self.tp, device=self.device, backend=self.backend
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks per layer (layout: `ringserve.gpu.kv_cache`)."""
        self.kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)

    def release_kv_cache(self) -> None:
        """Drop the KV cache tensors and every request's state (sleep)."""
        self.kv_caches = []
        self.table = self._new_table()

    def release_model(self) -> None:
        """Drop the weights (sleep level 2); `load_model` brings them back."""
        self._model = None

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step and sample.

        Returns:
            the sampled tokens per scheduled request (empty for prompt chunks before the
            last), logprobs and prompt logprobs; per-request failures are in
            `self.request_errors` (see the module docstring).

        Raises:
            ValueError: the schedule disagrees with the worker's state (an engine fault).
            RuntimeError: no KV cache or model.
        """
        self.request_errors = {}
        if not self.kv_caches:
            raise RuntimeError("ModelRunner.initialize_kv_cache() must run before execute_model")
        self._apply_diff(scheduler_output)
        req_ids = [
            r for r in scheduler_output.num_scheduled_tokens
            if r in self.table.requests and r not in self.request_errors
        ]
        if not req_ids:
            return ModelRunnerOutput(step_id=scheduler_output.step_id,
                                     request_errors=dict(self.request_errors))
        num_scheduled = np.fromiter(
            (scheduler_output.num_scheduled_tokens[r] for r in req_ids), dtype=np.int32,
            count=len(req_ids),
        )
        inputs = prepare_inputs(self.table, req_ids, num_scheduled, self.device)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        prompt_logprobs = compute_prompt_logprobs(
            hidden, inputs, self.table, self.model.compute_logits, self.model_config.vocab_size
        )
        output = self._sample(hidden, inputs)
        output.prompt_logprobs = prompt_logprobs
        output.step_id = scheduler_output.step_id
        output.request_errors = dict(self.request_errors)
        return output

    def _apply_diff(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.table.finish(req_id)
        for req_id in so.preempted_req_ids:
            self.table.preempt(req_id)
        for new in so.scheduled_new_reqs:
            try:
                validate_request(new.prompt_token_ids, new.sampling_params, self.model_config)
                self.table.apply_new(new)
            except ValueError as exc:
                self.request_errors[new.req_id] = str(exc)
        for cached in so.scheduled_cached_reqs:
            if cached.req_id not in self.table.requests:
                if cached.req_id not in self.request_errors:
                    self.request_errors[cached.req_id] = f"request {cached.req_id!r} is unknown"
                continue
            self.table.apply_cached(cached)

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs) -> ModelRunnerOutput:
        sampled: list[list[int]] = [[] for _ in inputs.req_ids]
        rows = np.flatnonzero(inputs.samples)
        if rows.size == 0:
            return ModelRunnerOutput(step_id=0, req_ids=inputs.req_ids, sampled_token_ids=sampled)
        slots = inputs.slots[rows]
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        meta = build_sampling_metadata(
            self.table, slots, self.model_config.vocab_size, self.device
        )
        result = self.sampler.forward(logits, meta)
        ok = ~result.nan_rows
        for row in rows[result.nan_rows].tolist():
            self.request_errors[inputs.req_ids[row]] = (
                "the model produced NaN logits for this request; it cannot be sampled"
            )
        good_slots, tokens = slots[ok], result.token_ids[ok]
        for slot, token in zip(good_slots.tolist(), tokens.tolist(), strict=True):
            self.table.append_token(slot, token)
        for row, token in zip(rows[ok].tolist(), tokens.tolist(), strict=True):
            sampled[row] = [token]
        logprobs = None if result.logprobs is None else select_rows(result.logprobs, ok)
        return ModelRunnerOutput(
            step_id=0, req_ids=inputs.req_ids, sampled_token_ids=sampled, logprobs=logprobs
        )
