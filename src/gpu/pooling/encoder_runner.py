"""The encoder runner: steps of a bidirectional encoder (BERT, XLM-RoBERTa) for pooling requests.

The worker (`ringserve.gpu.worker`) builds this runner instead of the model runner when the
engine serves an encoder (`PoolerConfig.encoder`). An encoder has no KV cache: attention is
bidirectional over each input, so the scheduler runs every input whole in one step (chunked
prefill and the prefix cache are off for it, `ringserve.gpu.pooling.engine_config`), and each
step packs its inputs back to back with no padding (`EncoderModel.forward`), pools each input
(`ringserve.gpu.pooling.pooler`) and answers with the pooled rows in
`ModelRunnerOutput.pooled`. The block ids the scheduler books for an encoder's requests refer
to no memory (`kv_bytes_per_block` is 0).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ringserve.checkpoint.safetensors_file import TensorReader, checkpoint_files
from ringserve.config import EngineConfig, PoolerConfig
from ringserve.errors import ModelDirectoryError
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.pooling.encoder import EncoderModel, model_class_for
from ringserve.gpu.pooling.pooler import activate, finish_embedding, pool
from ringserve.gpu.runner.model_runner import ModelRunner
from ringserve.gpu.runner.validation import validate_request
from ringserve.gpu.weights.loader import fill_dummy_weights
from ringserve.gpu.wire import GrammarOutput, ModelRunnerOutput, NewRequestData, SchedulerOutput
from ringserve.pooling_params import PoolingParams

logger = logging.getLogger(__name__)


class EncoderRunner(ModelRunner):
    """Runs pooling steps of an encoder model on `device` (the model runner's interface, so
    the worker drives it unchanged; decoding, sampling and the KV cache do not apply)."""

    def __init__(self, config: EngineConfig, device: torch.device, tp: TPGroup | None = None,
                 attention_backend: Any = "auto") -> None:
        super().__init__(config, device, tp, attention_backend)
        if config.pooler_config is None:
            raise ValueError("EncoderRunner needs a pooler config (--runner pooling)")
        if self.tp.world_size != 1:
            raise ValueError("encoder models run with tensor_parallel_size 1")
        self.pooler_config: PoolerConfig = config.pooler_config
        self._encoder: EncoderModel | None = None
        self._inputs: dict[str, NewRequestData] = {}
        self._ready = False

    @property
    def encoder(self) -> EncoderModel:
        """The loaded encoder.

        Raises:
            RuntimeError: `load_model` has not run.
        """
        if self._encoder is None:
            raise RuntimeError("EncoderRunner.load_model() must run before the model is used")
        return self._encoder

    def load_model(self, weights_path: str | None = None) -> None:
        """Build the encoder and load its weights from the checkpoint."""
        config = self.model_config
        cls = model_class_for(config.architecture)
        if cls is None:
            raise ValueError(f"{config.architecture} is not an encoder architecture")
        with torch.device(self.device):
            model = cls.from_config(config)
        if config.load_format == "dummy" and weights_path is None:
            fill_dummy_weights(model, config.seed)
        else:
            reader = TensorReader(checkpoint_files(Path(weights_path or config.weights)))
            try:
                model.load_weights(reader)
            except (ValueError, RuntimeError) as exc:
                raise ModelDirectoryError(f"{reader.describe()}: {exc}") from None
        model.process_weights_after_loading()
        self._encoder = model.eval()

    @property
    def kv_bytes_per_block(self) -> int:
        """An encoder keeps no KV cache: its blocks are bookkeeping only."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Nothing to allocate; the runner is ready for steps."""
        self._ready = True

    def capture_decode(self) -> None:
        """An encoder never decodes."""
        self.capture = None
        self.capture_reason = "encoders do not decode"

    def release_kv_cache(self) -> None:
        """Drop every request's state (sleep)."""
        self._inputs.clear()
        self._ready = False

    def release_model(self) -> None:
        """Drop the weights (sleep level 2)."""
        self._encoder = None

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run each scheduled input whole and pool it.

        Raises:
            ValueError: the schedule splits an input across steps (an encoder runs it whole).
            RuntimeError: the runner has no model or was not initialised.
        """
        self.request_errors = {}
        if not self._ready:
            raise RuntimeError("EncoderRunner.initialize_kv_cache() must run before execute_model")
        self._take_diff(scheduler_output)
        req_ids: list[str] = []
        prompts: list[list[int]] = []
        params: list[PoolingParams] = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            new = self._inputs.get(req_id)
            if new is None or req_id in self.request_errors:
                continue
            if new.pooling_params is None:
                self.request_errors[req_id] = "an encoder only pools; it cannot generate"
                continue
            if n != len(new.prompt_token_ids):
                raise ValueError(f"request {req_id!r}: an encoder runs an input whole in one "
                                 f"step (scheduled {n} of {len(new.prompt_token_ids)} tokens)")
            req_ids.append(req_id)
            prompts.append(new.prompt_token_ids)
            params.append(new.pooling_params)
        pooled = self._run(req_ids, prompts, params) if req_ids else {}
        return ModelRunnerOutput(
            step_id=scheduler_output.step_id, req_ids=req_ids,
            sampled_token_ids=[[] for _ in req_ids], request_errors=dict(self.request_errors),
            pooled=pooled)

    def skip_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """A skipped step (pause): its inputs are kept and run when scheduled again."""
        self.request_errors = {}
        self._take_diff(scheduler_output)
        ids = [r for r in scheduler_output.num_scheduled_tokens
               if r in self._inputs and r not in self.request_errors]
        return ModelRunnerOutput(step_id=scheduler_output.step_id, req_ids=ids,
                                 sampled_token_ids=[[] for _ in ids],
                                 request_errors=dict(self.request_errors), skipped=True)

    def sample_tokens(self, grammar: GrammarOutput) -> ModelRunnerOutput | None:
        """Pooling requests carry no grammar.

        Raises:
            ValueError: always (a grammar for an encoder step is an engine fault).
        """
        raise ValueError(f"sample_tokens: step {grammar.step_id} has a grammar, but an encoder "
                         "samples nothing")

    def _take_diff(self, so: SchedulerOutput) -> None:
        inputs = self._inputs
        for req_id in so.finished_req_ids:
            inputs.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            inputs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            try:
                validate_request(new.prompt_token_ids, new.sampling_params, self.model_config)
            except ValueError as exc:
                self.request_errors[new.req_id] = str(exc)
                continue
            inputs[new.req_id] = new
        for cached in so.scheduled_cached_reqs:
            if cached.resumed_from_preemption and cached.req_id in inputs:
                continue
            if cached.req_id not in inputs:
                self.request_errors[cached.req_id] = f"request {cached.req_id!r} is unknown"

    def _run(self, req_ids: list[str], prompts: list[list[int]],
             params: list[PoolingParams]) -> dict[str, np.ndarray[Any, Any]]:
        lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
        starts = np.zeros(len(prompts) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        flat = np.fromiter((t for p in prompts for t in p), dtype=np.int64, count=int(starts[-1]))
        input_ids = torch.from_numpy(flat).to(self.device)
        token_types = None
        if self.encoder.type_vocab_size > 1 and any(p.token_type_start is not None
                                                     for p in params):
            types = np.zeros(int(starts[-1]), dtype=np.int64)
            for i, p in enumerate(params):
                if p.token_type_start is not None:
                    types[starts[i] + min(p.token_type_start, int(lengths[i])):starts[i + 1]] = 1
            token_types = torch.from_numpy(types).to(self.device)
        hidden = self.encoder.forward(input_ids, starts, token_types)
        return self._pool(req_ids, hidden, starts, params)

    def _pool(self, req_ids: list[str], hidden: torch.Tensor, starts: np.ndarray[Any, Any],
              params: list[PoolingParams]) -> dict[str, np.ndarray[Any, Any]]:
        cfg = self.pooler_config
        out: dict[str, np.ndarray[Any, Any]] = {}
        embed = [i for i, p in enumerate(params) if p.task == "embed"]
        if embed:
            rows = pool(hidden, starts, cfg.pooling_type)
            for i in embed:
                p = params[i]
                normalize = cfg.normalize if p.normalize is None else p.normalize
                try:
                    vector = finish_embedding(rows[i:i + 1], normalize, p.dimensions)[0]
                except ValueError as exc:  # dimensions past the hidden size
                    self.request_errors[req_ids[i]] = str(exc)
                    continue
                out[req_ids[i]] = vector.float().cpu().numpy()
        heads = [i for i, p in enumerate(params) if p.task in ("classify", "score")]
        if heads:
            if self.encoder.num_labels == 0:
                for i in heads:
                    self.request_errors[req_ids[i]] = (
                        "this model has no classification head (it is an embedding model)")
            else:
                first = hidden[torch.from_numpy(starts[:-1][heads]).to(hidden.device)]
                logits = self.encoder.classify(first)
                for j, i in enumerate(heads):
                    row = logits[j:j + 1]
                    if params[i].activation is not False:
                        row = activate(row)
                    out[req_ids[i]] = row[0].float().cpu().numpy()
        for i, p in enumerate(params):
            if p.task == "token_embed":
                rows = hidden[int(starts[i]):int(starts[i + 1])]
                normalize = cfg.normalize if p.normalize is None else p.normalize
                try:
                    out[req_ids[i]] = finish_embedding(rows, normalize,
                                                       p.dimensions).float().cpu().numpy()
                except ValueError as exc:
                    self.request_errors[req_ids[i]] = str(exc)
            elif p.task == "token_classify":
                self.request_errors[req_ids[i]] = (
                    "token_classify: this model classifies whole inputs, not tokens")
        return {r: v for r, v in out.items() if r not in self.request_errors}
