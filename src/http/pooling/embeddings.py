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

from starlette.requests import Request
from starlette.responses import Response

from ringserve.config import PoolerConfig
from ringserve.engine.frontend.pooling_inputs import check_dimensions
from ringserve.http.context import AppContext
from ringserve.http.errors import APIError, bad_request
from ringserve.http.pooling.inputs import pooler_of
from ringserve.http.pooling.protocol import EmbeddingRequest, PoolingRequest, parse_body
from ringserve.http.pooling.responses import (
    EmbeddingData,
    EmbeddingResponse,
    PoolingData,
    PoolingResponse,
    encode_vector,
    now,
    usage_of,
)
from ringserve.http.pooling.runner import DISCONNECTED, pool_inputs
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

    async def create(self, request: Request) -> Response:
        """`POST /v1/embeddings`."""
        ctx = self.ctx
        req = await parse_body(ctx, request, EmbeddingRequest, "/v1/embeddings")
        ctx.check_model(req.model)
        pooler = embedding_pooler(ctx, "/v1/embeddings")
        check_dimensions(req.dimensions, pooler, ctx.engine.config.model_config.hidden_size)
        params = PoolingParams(task="embed", normalize=req.normalize, dimensions=req.dimensions)
        pooled = await pool_inputs(ctx, request, req.input, params, id_prefix="embd",
                                   given_id=req.request_id, priority=req.priority,
                                   truncate_prompt_tokens=req.truncate_prompt_tokens,
                                   add_special_tokens=req.add_special_tokens)
        if pooled is None:
            return Response(status_code=DISCONNECTED)
        data = [EmbeddingData(index=i, embedding=encode_vector(out, req.encoding_format))
                for i, out in enumerate(pooled.outputs)]
        return json_response(EmbeddingResponse(
            id=pooled.request_id, created=now(), model=ctx.response_model(req.model),
            data=data, usage=usage_of(pooled.prompt_tokens)))

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
            name = "dimensions" if req.dimensions is not None else "normalize"
            raise bad_request(f"{name}: only for the embed and token_embed tasks (this "
                              "request's task is classify)", name)
        check_dimensions(req.dimensions, pooler, ctx.engine.config.model_config.hidden_size)
        params = PoolingParams(task=task, normalize=req.normalize, dimensions=req.dimensions,
                               activation=req.activation)
        pooled = await pool_inputs(ctx, request, req.input, params, id_prefix="pool",
                                   given_id=req.request_id, priority=req.priority,
                                   truncate_prompt_tokens=req.truncate_prompt_tokens,
                                   add_special_tokens=req.add_special_tokens)
        if pooled is None:
            return Response(status_code=DISCONNECTED)
        data = [PoolingData(index=i, data=encode_vector(out, req.encoding_format))
                for i, out in enumerate(pooled.outputs)]
        return json_response(PoolingResponse(
            id=pooled.request_id, created=now(), model=ctx.response_model(req.model),
            data=data, usage=usage_of(pooled.prompt_tokens)))
