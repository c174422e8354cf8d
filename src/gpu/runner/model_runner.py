"""The model runner: one step from a SchedulerOutput to a ModelRunnerOutput on one device.

Owns the loaded model, the KV cache tensors, the persistent request table and the sampler, and
wires the small modules together (MRV2-style): apply the step's diff to the table
(`ringserve.gpu.runner.request_state`), build the flat batch (`ringserve.gpu.runner.input_prep`), run the
model, compute prompt logprobs (`ringserve.gpu.sample.prompt_logprobs`), gather sampling metadata
(`ringserve.gpu.sample.sampling_metadata`) and sample (`ringserve.gpu.sample.sampler`). The worker
(`ringserve.gpu.worker`) owns the runner; tests drive it directly with hand-built schedules.

A step of single-token decodes runs through the captured decode step when there is one
(`ringserve.gpu.runner.decode_capture`, built with the KV cache unless `--enforce-eager`); every
other step runs the model eagerly.

Per-request failures do not raise: a new request that does not validate is left out of the
batch (absent from `req_ids`), a request whose logits hold a NaN gets an empty sampled list, and
both get a message in `request_errors` for this step; the rest of the batch goes on.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ringserve.checkpoint.precision import BF16_WEIGHTS
from ringserve.config import EngineConfig
from ringserve.gpu.attention.backend import BackendName, TorchAttentionBackend, select_backend
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.lora.manager import LoRAManager
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.models.moe import MoeForCausalLM
from ringserve.gpu.moe.layer import FusedMoE
from ringserve.gpu.multimodal.models import image_seam, vision_of
from ringserve.gpu.native import panel as panel_native
from ringserve.gpu.pooling.decoder import DecoderPooler
from ringserve.gpu.runner.decode_capture import DecodeCapture, StepAborted, abort_check
from ringserve.gpu.runner.input_prep import StepInputs, prepare_inputs
from ringserve.gpu.runner.kv_cache import KVCacheSpec, allocate_kv_cache
from ringserve.gpu.runner.request_state import RequestTable
from ringserve.gpu.runner.validation import validate_request
from ringserve.gpu.sample.bad_words import bad_words_encoder
from ringserve.gpu.sample.grammar_mask import apply_bitmask
from ringserve.gpu.sample.logprobs import select_rows
from ringserve.gpu.sample.prompt_logprobs import compute_prompt_logprobs
from ringserve.gpu.sample.rejection import sample_with_drafts
from ringserve.gpu.sample.sampler import Sampler
from ringserve.gpu.sample.sampling_metadata import build_sampling_metadata
from ringserve.gpu.spec_decode.proposer import Proposer, make_proposer
from ringserve.gpu.spec_decode.verify import VerifyStep, prepare_verify
from ringserve.gpu.weights.loader import load_model
from ringserve.gpu.wire import GrammarOutput, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _ForwardDone:
    """A step whose forward has run and that waits to be sampled."""

    step_id: int
    hidden: torch.Tensor | None  # None: no request of the step could run here
    inputs: StepInputs | None
    prompt_logprobs: Any
    verify: VerifyStep | None = None  # the step verifies drafts (speculative decoding)
    num_spec_tokens: int = 0  # drafts to propose for the next step
    features: torch.Tensor | None = None  # the target's hidden states an EAGLE head reads


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
        if (isinstance(self.backend, TorchAttentionBackend)
                and self.model_config.weight_format == BF16_WEIGHTS and panel_native.native_bf16()):
            # A bf16 checkpoint's long prefills attend in bf16, as its GEMMs multiply
            # (`ringserve.gpu.native.panel._bf16_rows`); decodes stay float32.
            self.backend.prefill_dtype = torch.bfloat16
        self.kv_spec = KVCacheSpec.from_config(
            config.model_config, config.cache_config, self.tp.world_size
        )
        self.table = self._new_table()
        self.sampler = Sampler()
        self._model: LlamaForCausalLM | None = None
        # Speculative decoding's proposer (`ringserve.gpu.spec_decode`; None: off).
        self.proposer: Proposer | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.request_errors: dict[str, str] = {}
        self._awaiting_grammar: _ForwardDone | None = None
        self.capture: DecodeCapture | None = None
        self.capture_reason = "not captured yet"
        # The address of the step-hold byte (`ringserve.gpu.executor.step_hold`), read by the
        # captured decode step between layers: raised, the step ends there and is answered
        # as skipped. 0: steps always run to the end.
        self.abort_flag = 0
        # Constrained steps skipped or ended that way: the bitmask still coming for one is
        # dropped (`sample_tokens`).
        self._dropped_grammar: set[int] = set()
        # Per MoE layer, tokens routed to each expert (`enable_expert_load`); None: not counted.
        self._expert_load: list[torch.Tensor] | None = None
        # A decoder served for pooling (`ringserve.gpu.pooling.decoder`): its steps are
        # pooled, never sampled. None: the model generates.
        pooler = config.pooler_config
        self.pooler = DecoderPooler(pooler) if pooler is not None and not pooler.encoder else None
        # LoRA adapters (`ringserve.gpu.lora`; None: off).
        self.lora = (LoRAManager(config.lora_config, config.model_config, device)
                     if config.lora_config is not None else None)
        # Images (`ringserve.gpu.multimodal`; None: a text-only model).
        self.images = image_seam(config, device)

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

    def load_model(self, weights_path: str | None = None) -> None:
        """Build the model and load its weights (see `ringserve.gpu.weights.loader`): from the
        checkpoint, or from `weights_path` (a safetensors directory) when given."""
        config = self.model_config
        if weights_path is not None:
            config = dataclasses.replace(config, load_format="safetensors",
                                         weights_path=weights_path)
        self._model = load_model(config, tp=self.tp, device=self.device, backend=self.backend)
        if self.pooler is not None:
            self.pooler.load_head(config, self.device)
        if self.lora is not None:
            self.lora.install(self._model)
        if self.images is not None:
            self.images.attach(vision_of(self._model))
        self._attach_expert_load()  # a reload keeps counting into the same tensors
        if self.proposer is None:
            self.proposer = make_proposer(self.config, self.device, self.tp, self.backend,
                                          lambda: self.model)

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes one block of the pool takes on this rank: the target's KV, plus a draft
        model's (speculative decoding) over the same block ids."""
        extra = self.proposer.kv_bytes_per_block if self.proposer is not None else 0
        return self.kv_spec.bytes_per_block + extra

    def swap_model(self, model: LlamaForCausalLM) -> LlamaForCausalLM:
        """Serve `model` from the next step on (a weight update's standby copy, loaded and
        processed); returns the model it replaces. The decode step is captured again over
        the new weights (its tables point at them)."""
        old = self.model
        self._model = model
        if self.lora is not None:
            self.lora.install(model)  # the adapters stay across a weight update
        if self.images is not None:  # encoder rows of the old weights are stale
            self.images.attach(vision_of(model), fresh=True)
        self._attach_expert_load()
        self.capture_decode()
        return old

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks per layer (layout: `ringserve.gpu.runner.kv_cache`), and
        capture the decode step over them (`capture_decode`)."""
        self.kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        self.capture_decode()
        if self.proposer is not None:
            self.proposer.initialize_kv_cache(num_blocks)

    def capture_decode(self) -> None:
        """Build the captured decode step for the loaded model and KV cache, unless
        `--enforce-eager`; the reason a model runs eagerly is logged once."""
        self.capture = None
        compilation = self.config.compilation_config
        if compilation.enforce_eager:
            self.capture_reason = "--enforce-eager"
            return
        if self._model is None or not self.kv_caches:
            self.capture_reason = "no model or KV cache"
            return
        library = panel_native.load_library() if self.device.type == "cpu" else None
        self.capture, self.capture_reason = DecodeCapture.build(
            library, self._model, self.kv_caches, compilation.capture_sizes,
            backend=self.backend.name, tp_size=self.tp.world_size,
            max_batch=self.config.scheduler_config.max_num_seqs * (1 + self._max_drafts))
        if self.capture is not None:
            info = self.capture.info
            logger.info("decode step captured for batch sizes up to %d (%s weights) in %.3f s",
                        self.capture.max_batch, "/".join(info.weight_formats), info.seconds)
        else:
            logger.info("decode steps run eagerly: %s", self.capture_reason)

    @property
    def _max_drafts(self) -> int:
        """The most drafts a request verifies in one step (its step lays out `1 + k` rows)."""
        spec = self.config.speculative_config
        return spec.num_speculative_tokens if spec is not None else 0

    def dummy_pass(self) -> None:
        """The model's expert-parallel exchanges with no token (a no-op for dense models)."""
        dummy = getattr(self._model, "dummy_pass", None)
        if dummy is not None:
            dummy()

    def enable_expert_load(self) -> None:
        """Count, from now on, the tokens routed to each expert of every MoE layer
        (`FusedMoE.load_counts`), when --enable-expert-load-metrics asks for it; on TP rank 0
        only (every rank routes the same tokens). Called once serving starts (after the KV
        cache is sized, so the profiling forward is not counted); the counts then live on
        across reloads of the model."""
        if not self.config.observability_config.record_expert_load or self.tp.rank != 0:
            return
        if self._expert_load is None:
            self._expert_load = [torch.zeros(layer.num_experts, dtype=torch.int64,
                                             device=self.device)
                                 for layer in self._moe_layers()]
        self._attach_expert_load()
        if self.capture is not None:
            self.capture_decode()  # the captured step counts into the same tensors

    def expert_load(self) -> list[list[int]]:
        """The counts since `enable_expert_load`: per MoE layer (in layer order), per expert;
        empty where nothing is counted."""
        if self._expert_load is None:
            return []
        return [counts.tolist() for counts in self._expert_load]

    def _moe_layers(self) -> list[FusedMoE]:
        model = self._model
        return model.moe_layers() if isinstance(model, MoeForCausalLM) else []

    def _attach_expert_load(self) -> None:
        if self._expert_load is not None:
            for layer, counts in zip(self._moe_layers(), self._expert_load, strict=True):
                layer.load_counts = counts

    def release_kv_cache(self) -> None:
        """Drop the KV cache tensors and every request's state (sleep)."""
        self.kv_caches = []
        self.capture = None
        self.table = self._new_table()
        if self.proposer is not None:
            self.proposer.release_kv_cache()

    def release_model(self) -> None:
        """Drop the weights (sleep level 2); `load_model` brings them back."""
        self._model = None
        self.capture = None
        self.proposer = None  # a draft model's weights go too; `load_model` builds it again

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one scheduled step and sample.

        Returns:
            the sampled tokens per scheduled request (empty for prompt chunks before the
            last), logprobs and prompt logprobs; per-request failures are in
            `self.request_errors` (see the module docstring). None when the step has
            constrained rows (`grammar_req_ids`): the forward ran, and `sample_tokens` with
            the step's grammar bitmask samples it.

        Raises:
            ValueError: the schedule disagrees with the worker's state (an engine fault).
            RuntimeError: no KV cache or model.
        """
        self.request_errors = {}
        if not self.kv_caches:
            raise RuntimeError("ModelRunner.initialize_kv_cache() must run before execute_model")
        # A bitmask for a step ended early came before this step (frames arrive in order).
        self._dropped_grammar.clear()
        self._apply_diff(scheduler_output)
        req_ids = [
            r for r in scheduler_output.num_scheduled_tokens
            if r in self.table.requests and r not in self.request_errors
        ]
        if not req_ids:
            if self.config.parallel_config.lockstep:
                self.dummy_pass()  # the other cores' forwards wait for this one's exchanges
            empty = _ForwardDone(scheduler_output.step_id, None, None, None)
            if scheduler_output.grammar_req_ids:
                self._awaiting_grammar = empty  # its grammar still comes: answer that
                return None
            return self._finish(empty, None)
        num_scheduled = np.fromiter(
            (scheduler_output.num_scheduled_tokens[r] for r in req_ids), dtype=np.int32,
            count=len(req_ids),
        )
        verify = None
        if scheduler_output.spec_token_ids:
            verify = prepare_verify(self.table, req_ids, num_scheduled,
                                    scheduler_output.spec_token_ids, self.device)
            inputs = verify.inputs
        else:
            inputs = prepare_inputs(self.table, req_ids, num_scheduled, self.device)
        if self.lora is not None:  # which rows run under which adapter
            self.request_errors.update(self.lora.prepare(inputs.req_ids, inputs.num_scheduled))
        image_rows, eager = None, False
        if self.images is not None:
            inputs, image_rows, eager = self.images.prepare(inputs, self.table,
                                                            self.request_errors)
        self.model.model.embed_rows = image_rows
        # What an EAGLE head reads (None: nothing; (): the final hidden states; else the
        # inputs of these layers, which the captured step and the eager stack both keep).
        features_of = self.proposer.feature_layers if self.proposer is not None else None
        kept: torch.Tensor | None = None
        if self.capture is not None and not eager and self.capture.accepts(inputs):
            # LoRA rows: the captured step adds their slots' deltas itself.
            lora_rows = self.lora.capture_rows(self.capture) if self.lora is not None else None
            try:
                hidden, kept = self.capture.run_keeping(inputs, self.abort_flag,
                                                        features_of or (), lora_rows)
            except StepAborted:  # a pause came mid-step: taken back like a skipped step
                return self._skipped(scheduler_output)
        else:
            # Where a pause may end a step (`abort_flag`), it ends an eager one between layers.
            self.model.model.between_layers = (abort_check(self.abort_flag) if self.abort_flag
                                               else None)
            self.model.model.aux_layers = features_of or ()
            try:
                hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches,
                                            inputs.meta)
            except StepAborted:
                return self._skipped(scheduler_output)
            finally:
                self.model.model.aux_layers = ()
            if features_of:
                kept = torch.cat(self.model.model.aux_hidden, dim=-1)
        features = kept if features_of else (hidden if features_of is not None else None)
        prompt_logprobs = compute_prompt_logprobs(
            hidden, inputs, self.table, self.model.compute_logits, self.model_config.vocab_size
        )
        if self.pooler is not None:  # a pooling model: pooled, never sampled
            return self.pooler.step_output(scheduler_output.step_id, hidden, inputs,
                                           self.request_errors)
        step = _ForwardDone(scheduler_output.step_id, hidden, inputs, prompt_logprobs, verify,
                            scheduler_output.num_spec_tokens if self.proposer else 0, features)
        if scheduler_output.grammar_req_ids:
            self._awaiting_grammar = step  # sampled by `sample_tokens`, once the mask is here
            return None
        return self._finish(step, None)

    def skip_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Take a step's bookkeeping without running it (a pause skips the steps queued
        when it came: `ringserve.gpu.executor.step_hold`): the table learns its new,
        finished and preempted requests, blocks and computed counts, and nothing is
        computed or sampled.

        Returns:
            an output marked `skipped` whose `req_ids` are the requests that would have
            sampled (each with an empty token list), and the requests the worker refused.
        """
        self.request_errors = {}
        self._apply_diff(scheduler_output)
        return self._skipped(scheduler_output)

    def _skipped(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The output of a step whose bookkeeping was applied and that samples nothing (the
        grammar bitmask that may follow it is dropped)."""
        if scheduler_output.grammar_req_ids:
            self._dropped_grammar.add(scheduler_output.step_id)
        table = self.table
        sampling: list[str] = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            state = table.requests.get(req_id)
            if state is None or req_id in self.request_errors or state.slot < 0:
                continue
            slot = state.slot
            if int(table.num_computed[slot]) + n >= int(table.num_tokens[slot]):
                sampling.append(req_id)
        return ModelRunnerOutput(
            step_id=scheduler_output.step_id, req_ids=sampling,
            sampled_token_ids=[[] for _ in sampling], request_errors=dict(self.request_errors),
            skipped=True,
        )

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarOutput) -> ModelRunnerOutput | None:
        """Sample the step whose forward `execute_model` ran, its constrained rows masked
        by `grammar` (the core's bitmask for the step). None (nothing to send) for the
        bitmask of a step that was skipped or ended early.

        Raises:
            ValueError: no step waits for a grammar, or it is another step's.
        """
        if grammar.step_id in self._dropped_grammar:
            self._dropped_grammar.discard(grammar.step_id)
            return None
        step, self._awaiting_grammar = self._awaiting_grammar, None
        if step is None or step.step_id != grammar.step_id:
            raise ValueError(f"sample_tokens: a grammar for step {grammar.step_id}, but the "
                             f"step waiting is {None if step is None else step.step_id}")
        return self._finish(step, grammar)

    def _finish(self, step: _ForwardDone, grammar: GrammarOutput | None) -> ModelRunnerOutput:
        if step.hidden is None or step.inputs is None:
            return ModelRunnerOutput(step_id=step.step_id, request_errors=dict(self.request_errors))
        if step.verify is not None:
            output = self._sample_drafts(step.hidden, step.verify, grammar)
        else:
            output = self._sample(step.hidden, step.inputs, grammar)
        if step.features is not None and self.proposer is not None:
            self.proposer.observe(self.table, step.inputs, step.features)
        if step.num_spec_tokens and self.proposer is not None:
            output.draft_token_ids = self._propose(output, step.num_spec_tokens)
        output.prompt_logprobs = step.prompt_logprobs
        output.step_id = step.step_id
        output.request_errors = dict(self.request_errors)
        return output

    def _apply_grammar(self, logits: torch.Tensor, req_ids: list[str], rows: np.ndarray[Any, Any],
                       grammar: GrammarOutput) -> None:
        """Mask the constrained rows' logits in place (before any sampling processor: a
        masked token stays at -inf through penalties, biases and temperature)."""
        position = {req_ids[r]: i for i, r in enumerate(rows.tolist())}
        mask_rows, logit_rows = [], []
        for j, rid in enumerate(grammar.req_ids):
            i = position.get(rid)
            if i is not None:  # absent: failed validation here, or not sampling this step
                mask_rows.append(j)
                logit_rows.append(i)
        if not mask_rows:
            return
        bitmask = torch.from_numpy(np.ascontiguousarray(grammar.bitmask[mask_rows]))
        apply_bitmask(logits, bitmask.to(logits.device),
                      torch.tensor(logit_rows, dtype=torch.int64, device=logits.device))

    def _apply_diff(self, so: SchedulerOutput) -> None:
        if self.images is not None:
            self.images.apply_diff(so, self.request_errors)
        if self.pooler is not None:
            self.pooler.apply_diff(so)
        if self.lora is not None:
            self.lora.apply_diff(so)
        if self.proposer is not None:
            self.proposer.forget([*so.finished_req_ids, *so.preempted_req_ids,
                                  *(c.req_id for c in so.scheduled_cached_reqs
                                    if c.resumed_from_preemption)])
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

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs,
                grammar: GrammarOutput | None = None) -> ModelRunnerOutput:
        sampled: list[list[int]] = [[] for _ in inputs.req_ids]
        rows = np.flatnonzero(inputs.samples)
        if rows.size == 0:
            return ModelRunnerOutput(step_id=0, req_ids=inputs.req_ids, sampled_token_ids=sampled)
        slots = inputs.slots[rows]
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        if grammar is not None and grammar.req_ids:
            self._apply_grammar(logits, inputs.req_ids, rows, grammar)
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

    def _sample_drafts(self, hidden: torch.Tensor, verify: VerifyStep,
                       grammar: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample a step that verifies drafts (`ringserve.gpu.sample.rejection`)."""
        compute_logits = self.model.compute_logits

        def logits_at(rows: np.ndarray[Any, Any]) -> torch.Tensor:
            return compute_logits(hidden[torch.from_numpy(rows).to(hidden.device)])

        mask = None
        if grammar is not None and grammar.req_ids:
            rows_of: dict[str, list[int]] = {}  # request -> its bitmask rows, by position
            for row, rid in enumerate(grammar.req_ids):
                rows_of.setdefault(rid, []).append(row)
            bits = torch.from_numpy(np.ascontiguousarray(grammar.bitmask))

            def mask(logits: torch.Tensor, requests: list[int], position: int) -> None:
                mask_rows, logit_rows = [], []
                for i, request in enumerate(requests):
                    rows = rows_of.get(verify.req_ids[request])
                    if rows is not None and position < len(rows):
                        mask_rows.append(rows[position])
                        logit_rows.append(i)
                if mask_rows:
                    apply_bitmask(logits, bits[mask_rows].to(logits.device),
                                  torch.tensor(logit_rows, dtype=torch.int64,
                                               device=logits.device))

        result = sample_with_drafts(logits_at, verify.rows, verify.drafts, verify.slots,
                                    self.table, self.sampler, self.model_config.vocab_size,
                                    self.device, mask)
        for i, message in result.errors.items():
            self.request_errors[verify.req_ids[i]] = message
        return ModelRunnerOutput(step_id=0, req_ids=verify.req_ids,
                                 sampled_token_ids=result.sampled, logprobs=result.logprobs)

    def _propose(self, output: ModelRunnerOutput, k: int) -> dict[str, list[int]]:
        """Drafts for the next step of every request that sampled this one."""
        assert self.proposer is not None
        table = self.table
        ids = [r for r, tokens in zip(output.req_ids, output.sampled_token_ids, strict=True)
               if tokens and r not in self.request_errors and r in table.requests]
        if not ids:
            return {}
        slots = np.fromiter((table.slot_of(r) for r in ids), dtype=np.int64, count=len(ids))
        return self.proposer.propose(table, ids, slots, [k] * len(ids))
