"""`POST /v1/embeddings` (OpenAI's) and `POST /pooling` (vLLM's): vectors of inputs.

Each input (a string, or token ids; a request may carry many) is tokenized in one batch with
the others, checked, planned (`pooling_inputs.plan_inputs`: one engine request, or one per
chunk with `enable_chunked_processing`) and run concurrently with the others
(`ringserve.http.pooling.runner`). `/v1/embeddings` answers one embedding per input;
`/pooling` answers the task's output: the embedding, every token's hidden state
(`token_embed`) or a classifier's probabilities (`classify`). `dimensions` shortens a
Matryoshka model's embeddings (a 400 on any other model); `normalize` overrides the model's
normalisation.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ringserve.config import PoolerConfig
from ringserve.engine.frontend.pooling_inputs import FloatArray, check_dimensions, plan_inputs
from ringserve.http.context import AppContext, request_id_of
from ringserve.http.errors import APIError, bad_request
from ringserve.http.pooling.inputs import pooler_of, token_inputs
from ringserve.http.pooling.protocol import (
    EmbeddingRequest,
    PoolingRequest,
    inputs_of,
    parse_body,
)
from ringserve.http.pooling.responses import (
    EmbeddingData,
    EmbeddingResponse,
    PoolingData,
    PoolingResponse,
    encode_vector,
    now,
    response_id,
    usage_of,
)
from ringserve.http.pooling.runner import DISCONNECTED, run_plans
from ringserve.http.responses import json_response
from ringserve.pooling_params import PoolingParams, PoolingTask

# What `/pooling` computes on each kind of pooling model.
_TASKS: dict[str, tuple[PoolingTask, ...]] = {
    "embed": ("embed", "token_embed"),
    "classify": ("classify",),
}


def embedding_pooler(ctx: AppContext, route: str) -> PoolerConfig:
    """The pooler of an embedding model.

    Raises:
        APIError: 400 on a generation server or a classification model.
    """
    pooler = pooler_of(ctx, route)
    if pooler.convert != "embed":
        raise APIError(400, f"The model `{ctx.model_name}` is a classification model "
                       "(--convert classify), not an embedding model; use /classify, /score "
                       "or /rerank", "model")
    return pooler


class Embeddings:
    """The embeddings and pooling routes."""

    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx

    async def _run(self, request: Request, inputs: str | list[Any], params: PoolingParams,
                   *, truncate_prompt_tokens: int | None, add_special_tokens: bool,
                   id_prefix: str, given_id: str | None,
                   priority: int) -> tuple[str, list[FloatArray], int] | None:
        """The outputs of every input (None: the client left), with the response id and the
        prompt tokens."""
        ctx = self.ctx
        pooler = pooler_of(ctx, "pooling")
        ids = await token_inputs(ctx, inputs_of(inputs), field="input",
                                 truncate_prompt_tokens=truncate_prompt_tokens,
                                 add_special_tokens=add_special_tokens)
        plans = plan_inputs(ids, params, pooler, field="input")
        rid = response_id(id_prefix, request_id_of(request, given_id))
        outputs = await run_plans(ctx.engine, plans, rid, priority=priority,
                                  receive=request.receive)
        if outputs is None:
            return None
        return rid, outputs, sum(plan.num_tokens for plan in plans)

    async def create(self, request: Request) -> Response:
        """`POST /v1/embeddings`."""
        ctx = self.ctx
        req = await parse_body(ctx, request, EmbeddingRequest, "/v1/embeddings")
        ctx.check_model(req.model)
        pooler = embedding_pooler(ctx, "/v1/embeddings")
        check_dimensions(req.dimensions, pooler, ctx.engine.config.model_config.hidden_size)
        params = PoolingParams(task="embed", normalize=req.normalize, dimensions=req.dimensions)
        result = await self._run(request, req.input, params,
                                 truncate_prompt_tokens=req.truncate_prompt_tokens,
                                 add_special_tokens=req.add_special_tokens, id_prefix="embd",
                                 given_id=req.request_id, priority=req.priority)
        if result is None:
            return Response(status_code=DISCONNECTED)
        rid, outputs, prompt_tokens = result
        data = [EmbeddingData(index=i, embedding=encode_vector(out, req.encoding_format))
                for i, out in enumerate(outputs)]
        return json_response(EmbeddingResponse(
            id=rid, created=now(), model=ctx.response_model(req.model), data=data,
            usage=usage_of(prompt_tokens)))

    async def pool(self, request: Request) -> Response:
        """`POST /pooling`."""
        ctx = self.ctx
        req = await parse_body(ctx, request, PoolingRequest, "/pooling")
        ctx.check_model(req.model)
        pooler = pooler_of(ctx, "/pooling")
        allowed = _TASKS[pooler.convert]
        task = req.task if req.task is not None else allowed[0]
        if task not in allowed:
            raise bad_request(f"task: got {task!r}; this model ({pooler.convert}) allows: "
                              f"{', '.join(allowed)}", "task")
        if task == "classify" and (req.dimensions is not None or req.normalize is not None):
            raise bad_request("dimensions, normalize: only for the embed and token_embed "
                              "tasks", "dimensions" if req.dimensions is not None
                              else "normalize")
        check_dimensions(req.dimensions, pooler, ctx.engine.config.model_config.hidden_size)
        params = PoolingParams(task=task, normalize=req.normalize, dimensions=req.dimensions,
                               activation=req.activation)
        result = await self._run(request, req.input, params,
                                 truncate_prompt_tokens=req.truncate_prompt_tokens,
                                 add_special_tokens=req.add_special_tokens, id_prefix="pool",
                                 given_id=req.request_id, priority=req.priority)
        if result is None:
            return Response(status_code=DISCONNECTED)
        rid, outputs, prompt_tokens = result
        data = [PoolingData(index=i, data=encode_vector(out, req.encoding_format))
                for i, out in enumerate(outputs)]
        return json_response(PoolingResponse(
            id=rid, created=now(), model=ctx.response_model(req.model), data=data,
            usage=usage_of(prompt_tokens)))
