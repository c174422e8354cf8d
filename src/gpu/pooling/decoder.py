"""Pooling the hidden states of a decoder (Qwen3-Embedding, gte-Qwen2 style embedders) inside
the model runner.

A decoder embedder runs through the ordinary model runner (`ringserve.gpu.runner.
model_runner`): causal attention over its KV cache, chunked prefill, and for LAST pooling the
prefix cache. The runner hands each step's final-norm hidden states here instead of sampling:
`DecoderPooler.pool_step` keeps what each request's pooling needs across its prompt chunks
(the first row for CLS, a running sum for MEAN, every row for per-token outputs, nothing for
LAST) and returns the finished requests' outputs once their last prompt token was computed.
A request that is preempted starts again from its first token, so its partial state is dropped
(`forget`). A `*ForSequenceClassification` checkpoint's head (`score.weight`) reads the last
token's hidden state (`load_head`), as transformers' classifiers do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ringserve.checkpoint.safetensors_file import checkpoint_files, read_named_tensor
from ringserve.config import ModelConfig, PoolerConfig
from ringserve.errors import ModelDirectoryError
from ringserve.gpu.pooling.pooler import activate, finish_embedding
from ringserve.gpu.runner.input_prep import StepInputs
from ringserve.gpu.wire import ModelRunnerOutput, SchedulerOutput
from ringserve.pooling_params import PoolingParams

__all__ = ["DecoderPooler"]


class DecoderPooler:
    """Per-request pooling state of a decoder's prompts, fed one step at a time.

    Args:
        config: the resolved pooler (pooling type, normalisation).
    """

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        # A classifier's head (`score.weight`, [num_labels, hidden]; `load_head`).
        self.head: torch.Tensor | None = None
        self.params: dict[str, PoolingParams] = {}
        self._first: dict[str, torch.Tensor] = {}  # CLS: the first token's row
        self._sum: dict[str, torch.Tensor] = {}  # MEAN: the rows' running sum
        self._count: dict[str, int] = {}
        self._rows: dict[str, list[torch.Tensor]] = {}  # per-token outputs

    def add(self, req_id: str, params: PoolingParams) -> None:
        """Start pooling a request the worker sees for the first time."""
        self.params[req_id] = params
        self._drop_state(req_id)

    def load_head(self, model_config: ModelConfig, device: torch.device) -> None:
        """Read a `*ForSequenceClassification` checkpoint's head (`score.weight`), which the
        model's own loader leaves out; nothing for an embedding model.

        Raises:
            ModelDirectoryError: a classifier checkpoint without `score.weight`.
        """
        if self.config.convert != "classify":
            return
        files = checkpoint_files(Path(model_config.weights))
        head = read_named_tensor(files, "score.weight")
        if head is None:
            raise ModelDirectoryError(f"{model_config.weights}: a classifier checkpoint "
                                      "without its head tensor 'score.weight'")
        self.head = head.to(device=device, dtype=torch.float32)

    def apply_diff(self, so: SchedulerOutput) -> None:
        """Follow a step's diff: new requests start, finished ones go, preempted and resumed
        ones start again from their first token."""
        self.forget(so.finished_req_ids)
        self.forget([*so.preempted_req_ids,
                     *(c.req_id for c in so.scheduled_cached_reqs if c.resumed_from_preemption)],
                    keep_params=True)
        for new in so.scheduled_new_reqs:
            if new.pooling_params is not None:
                self.add(new.req_id, new.pooling_params)

    def step_output(self, step_id: int, hidden: torch.Tensor, inputs: StepInputs,
                    request_errors: dict[str, str]) -> ModelRunnerOutput:
        """The model runner's answer for a pooling step (`pool_step` over its batch); the
        requests that cannot be pooled are added to `request_errors`."""
        pooled, errors = self.pool_step(hidden, inputs.req_ids, inputs.query_start_loc,
                                        inputs.positions_np, inputs.samples)
        request_errors.update(errors)
        return ModelRunnerOutput(step_id=step_id, req_ids=inputs.req_ids,
                                 sampled_token_ids=[[] for _ in inputs.req_ids],
                                 request_errors=dict(request_errors), pooled=pooled)

    def forget(self, req_ids: list[str], *, keep_params: bool = False) -> None:
        """Drop requests that finished (or, with `keep_params`, restart from their first token:
        preempted or resumed)."""
        for req_id in req_ids:
            if not keep_params:
                self.params.pop(req_id, None)
            self._drop_state(req_id)

    def _drop_state(self, req_id: str) -> None:
        self._first.pop(req_id, None)
        self._sum.pop(req_id, None)
        self._count.pop(req_id, None)
        self._rows.pop(req_id, None)

    def pool_step(self, hidden: torch.Tensor, req_ids: list[str],
                  query_start_loc: np.ndarray[Any, Any], positions: np.ndarray[Any, Any],
                  finishes: np.ndarray[Any, Any]) -> tuple[dict[str, np.ndarray[Any, Any]],
                                                           dict[str, str]]:
        """Fold one step's hidden rows in; pool the requests whose prompt ends this step.

        Args:
            hidden: [T, H] the step's final-norm hidden states.
            req_ids: the step's requests, in batch order.
            query_start_loc: int [B + 1] host prefix sums of their rows.
            positions: int [T] host positions of the rows.
            finishes: bool [B]: the request's last prompt token is computed this step.

        Returns:
            The finished requests' outputs (request id -> float32 array) and the requests
            that cannot be pooled (request id -> why).
        """
        pooling_type = self.config.pooling_type
        outputs: dict[str, np.ndarray[Any, Any]] = {}
        errors: dict[str, str] = {}
        for i, req_id in enumerate(req_ids):
            params = self.params.get(req_id)
            if params is None:
                errors[req_id] = "a generation request reached a pooling model"
                continue
            start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
            rows = hidden[start:end]
            task = params.task
            if task == "token_embed":
                self._rows.setdefault(req_id, []).append(rows.float().clone())
            elif task in ("classify", "score"):
                if self.head is None:
                    errors[req_id] = (f"{task}: this decoder model has no classification head "
                                      "(it is an embedding model)")
                    continue
            elif task != "embed":
                errors[req_id] = f"{task}: not supported by a decoder pooling model"
                continue
            elif pooling_type == "CLS":
                if int(positions[start]) == 0:
                    self._first[req_id] = rows[0].float().clone()
            elif pooling_type == "MEAN":
                total = rows.float().sum(dim=0)
                if req_id in self._sum:
                    total = total + self._sum[req_id]
                self._sum[req_id] = total
                self._count[req_id] = self._count.get(req_id, 0) + (end - start)
            if not finishes[i]:
                continue
            try:
                outputs[req_id] = self._finish(req_id, params, rows)
            except ValueError as exc:
                errors[req_id] = str(exc)
            self._drop_state(req_id)
        return outputs, errors

    def _finish(self, req_id: str, params: PoolingParams,
                last_rows: torch.Tensor) -> np.ndarray[Any, Any]:
        if params.task in ("classify", "score"):
            assert self.head is not None
            # The classifier reads the last token (transformers' *ForSequenceClassification).
            logits = last_rows[-1:].float() @ self.head.T
            if params.activation is not False:
                logits = activate(logits)
            return logits[0].cpu().numpy()
        normalize = self.config.normalize if params.normalize is None else params.normalize
        if params.task == "token_embed":
            rows = torch.cat(self._rows.get(req_id, []), dim=0)
            return finish_embedding(rows, normalize, params.dimensions).cpu().numpy()
        pooling_type = self.config.pooling_type
        if pooling_type == "LAST":
            vector = last_rows[-1].float()
        elif pooling_type == "CLS":
            if req_id not in self._first:
                raise ValueError("CLS pooling needs the first token computed (prefix cache "
                                 "hit)")
            vector = self._first[req_id]
        else:
            vector = self._sum[req_id] / self._count[req_id]
        return finish_embedding(vector[None], normalize, params.dimensions)[0].cpu().numpy()
