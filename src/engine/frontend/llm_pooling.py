"""The offline `LLM`'s pooling methods (vLLM's): `encode`, `embed`, `classify`, `score`.

Mixed into `ringserve.LLM`. Inputs are tokenized in one batch call and planned by
`ringserve.engine.frontend.pooling_inputs` (truncation, the model's length, chunked
processing), every request is queued before the engine runs, and the answers come back in input
order as vLLM's output objects (`.outputs.embedding`, `.outputs.probs`, `.outputs.score`). A bad
input raises `ValueError` before anything is queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ringserve.config import PoolerConfig
from ringserve.engine.errors import EngineGenerateError
from ringserve.engine.frontend.input_processor import PromptType
from ringserve.engine.frontend.llm_engine import LLMEngine
from ringserve.engine.frontend.pooling import pooling_sampling_params
from ringserve.engine.frontend.pooling_inputs import (
    InputPlan,
    TokenizedInput,
    check_dimensions,
    check_token_ids,
    cosine_similarity,
    plan_inputs,
    tokenize_pairs,
    tokenize_texts,
    truncate_token_ids,
    truncation_length,
)
from ringserve.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from ringserve.pooling_params import PoolingParams

__all__ = ["SyncPoolingMethods"]

_Prompts = PromptType | Sequence[PromptType]


class SyncPoolingMethods:
    """Pooling for `LLM` (a mixin over its `llm_engine` and request counter)."""

    llm_engine: LLMEngine
    _counter: Any

    # -- public API ------------------------------------------------------------------------

    def encode(self, prompts: _Prompts, pooling_params: PoolingParams | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """Pool every prompt (`pooling_task` or `pooling_params.task`: embed, classify,
        token_embed, ...); returns the outputs in input order.

        Raises:
            ValueError: a prompt or parameter is invalid, or the model does not pool.
        """
        params = pooling_params or PoolingParams()
        if pooling_task is not None:
            params = PoolingParams(task=pooling_task,  # type: ignore[arg-type]
                                   normalize=params.normalize, dimensions=params.dimensions,
                                   activation=params.activation)
        inputs = self._tokenize(prompts, truncate_prompt_tokens)
        plans = self._plan(inputs, params)
        results = self._run_plans(plans)
        return [PoolingRequestOutput(str(i), PoolingOutput(data), list(tokens.token_ids))
                for i, (data, tokens) in enumerate(zip(results, inputs, strict=True))]

    def embed(self, prompts: _Prompts, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`), in input order.

        Raises:
            ValueError: as `encode`; `dimensions` on a model that is not Matryoshka.
        """
        params = _with_task(pooling_params, "embed")
        check_dimensions(params.dimensions, self._pooler(), self._hidden_size())
        outs = self.encode(prompts, params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data.tolist()),
                                       o.prompt_token_ids) for o in outs]

    def classify(self, prompts: _Prompts, *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
                 ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (`.outputs.probs`), in input order.

        Raises:
            ValueError: as `encode`; the model is not a classifier.
        """
        self._require_classifier("classify")
        params = _with_task(pooling_params, "classify")
        outs = self.encode(prompts, params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm)
        return [ClassificationRequestOutput(o.request_id,
                                            ClassificationOutput(o.outputs.data.tolist()),
                                            o.prompt_token_ids) for o in outs]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """Relevance of each pair: a cross-encoder's activated logit, or the cosine of two
        embeddings on an embedding model. One `data_1` scores against every `data_2`;
        otherwise the lists pair up index by index.

        Raises:
            ValueError: lists of different lengths, an empty list, or a bad input.
        """
        firsts, seconds = _pair_up(data_1, data_2)
        truncate = truncation_length(truncate_prompt_tokens, self._pooler())
        tokenizer = self.llm_engine.get_tokenizer()
        if self._pooler().convert == "classify":
            pairs = tokenize_pairs(tokenizer, firsts, seconds, truncate)
            check_token_ids([p.token_ids for p in pairs], self._vocab_size(), "data_1 / data_2",
                            "pair")
            params = _with_task(pooling_params, "score")
            results = self._run_plans(self._plan(pairs, params, field="data_1 / data_2"))
            return [ScoringRequestOutput(str(i), ScoringOutput(float(r.reshape(-1)[0])),
                                         p.token_ids)
                    for i, (r, p) in enumerate(zip(results, pairs, strict=True))]
        texts = list(dict.fromkeys([*firsts, *seconds]))
        embeddings = dict(zip(texts, (o.outputs.embedding for o in self.embed(
            texts, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
            pooling_params=pooling_params)), strict=True))
        return [ScoringRequestOutput(str(i), ScoringOutput(cosine_similarity(
            np.asarray(embeddings[a], dtype=np.float32), np.asarray(embeddings[b],
                                                                    dtype=np.float32))), [])
                for i, (a, b) in enumerate(zip(firsts, seconds, strict=True))]

    # -- internals ---------------------------------------------------------------------------

    def _pooler(self) -> PoolerConfig:
        pooler = self.llm_engine.config.pooler_config
        if pooler is None:
            raise ValueError("this model generates text; pooling needs a pooling model "
                             "(LLM(..., runner='pooling') with an embedding or "
                             "classification checkpoint)")
        return pooler

    def _hidden_size(self) -> int:
        return self.llm_engine.config.model_config.hidden_size

    def _vocab_size(self) -> int:
        return self.llm_engine.config.model_config.vocab_size

    def _require_classifier(self, what: str) -> None:
        if self._pooler().convert != "classify":
            raise ValueError(f"{what}: this model is an embedding model, not a classifier "
                             "(use embed, or a *ForSequenceClassification checkpoint)")

    def _tokenize(self, prompts: _Prompts, truncate_prompt_tokens: int | None,
                  ) -> list[TokenizedInput]:
        truncate = truncation_length(truncate_prompt_tokens, self._pooler())
        items = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        texts = [p for p in items if isinstance(p, str)]
        encoded = iter(tokenize_texts(self.llm_engine.get_tokenizer(), texts, truncate))
        ids: list[list[int]] = []
        for p in items:
            if isinstance(p, str):
                ids.append(next(encoded))
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                ids.extend(truncate_token_ids([list(p["prompt_token_ids"])], truncate))
            else:
                raise ValueError("prompts: each prompt is a string or a dict with "
                                 "prompt_token_ids")
        check_token_ids(ids, self._vocab_size(), "prompts", "prompt")
        return [TokenizedInput(i) for i in ids]

    def _plan(self, inputs: Sequence[TokenizedInput], params: PoolingParams,
              field: str = "prompts") -> list[InputPlan]:
        return plan_inputs(inputs, params, self._pooler(), field=field,
                           noun="pair" if field != "prompts" else "prompt")

    def _run_plans(self, plans: list[InputPlan]) -> list[np.ndarray[Any, Any]]:
        """Queue every job of every plan, run the engine until all are answered, and combine
        each plan's outputs (in plan order)."""
        engine = self.llm_engine
        sampling = pooling_sampling_params()
        processed = []
        for plan in plans:  # everything validated before anything is queued
            for job in plan.jobs:
                processed.append(engine.input_processor.process(
                    str(next(self._counter)), {"prompt_token_ids": job.prompt_token_ids},
                    sampling, pooling_params=job.params))
        ids = [engine.add_processed_request(request, text) for request, text in processed]
        user_ids = [request.request_id for request, _ in processed]
        done: dict[str, np.ndarray[Any, Any]] = {}
        try:
            while engine.has_unfinished_requests():
                step = engine.step_outputs()
                for out in step.pooling_outputs:
                    done[out.request_id] = out.outputs.data
                for failed in step.request_outputs:
                    if failed.finished:
                        reason = failed.outputs[0].stop_reason if failed.outputs else None
                        raise EngineGenerateError(
                            f"request {failed.request_id!r} failed: {reason}")
        except BaseException:
            engine.abort_request(user_ids)
            raise
        del ids
        results = []
        position = 0
        for plan in plans:
            outputs = [done[user_ids[position + j]] for j in range(len(plan.jobs))]
            position += len(plan.jobs)
            results.append(plan.combine(outputs))
        return results


def _with_task(params: PoolingParams | None, task: str) -> PoolingParams:
    base = params or PoolingParams()
    return PoolingParams(task=task, normalize=base.normalize,  # type: ignore[arg-type]
                         dimensions=base.dimensions, activation=base.activation)


def _pair_up(data_1: str | Sequence[str], data_2: str | Sequence[str],
             ) -> tuple[list[str], list[str]]:
    firsts = [data_1] if isinstance(data_1, str) else list(data_1)
    seconds = [data_2] if isinstance(data_2, str) else list(data_2)
    if not firsts or not seconds:
        raise ValueError("data_1 / data_2: got an empty list; allowed: at least one text each")
    if len(firsts) == 1 and len(seconds) > 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(f"data_1 / data_2: {len(firsts)} texts against {len(seconds)}; "
                         "allowed: one data_1 against any number, or lists of equal length")
    return firsts, seconds
