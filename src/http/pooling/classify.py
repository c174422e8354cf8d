"""`POST /classify` (vLLM's): a classifier's probabilities for each input, with the label of
the most probable class (the checkpoint's `id2label`).

Only a classification model serves it (a `*ForSequenceClassification` checkpoint, or
`--convert classify`); an embedding model answers a 400 naming `model`.
"""

from __future__ import annotations

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from ringserve.http.context import AppContext
from ringserve.http.errors import APIError
from ringserve.http.pooling.inputs import pooler_of
from ringserve.http.pooling.protocol import ClassificationRequest, parse_body
from ringserve.http.pooling.responses import (
    ClassificationData,
    ClassificationResponse,
    now,
    usage_of,
)
from ringserve.http.pooling.runner import DISCONNECTED, pool_inputs
from ringserve.http.responses import json_response
from ringserve.pooling_params import PoolingParams


class Classification:
    """The classify route."""

    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx

    async def create(self, request: Request) -> Response:
        """`POST /classify`."""
        ctx = self.ctx
        req = await parse_body(ctx, request, ClassificationRequest, "/classify")
        ctx.check_model(req.model)
        pooler = pooler_of(ctx, "/classify")
        if pooler.convert != "classify":
            raise APIError(400, f"The model `{ctx.model_name}` is not a classification model "
                           "(it serves embeddings); /classify needs a classifier "
                           "(a *ForSequenceClassification checkpoint, or --convert classify)",
                           "model")
        params = PoolingParams(task="classify", activation=req.activation)
        pooled = await pool_inputs(ctx, request, req.input, params, id_prefix="classify",
                                   given_id=req.request_id, priority=req.priority,
                                   truncate_prompt_tokens=req.truncate_prompt_tokens,
                                   add_special_tokens=req.add_special_tokens)
        if pooled is None:
            return Response(status_code=DISCONNECTED)
        labels = pooler.id2label
        data = []
        for i, probs in enumerate(pooled.outputs):
            top = int(np.argmax(probs))
            data.append(ClassificationData(
                index=i, label=labels[top] if top < len(labels) else None,
                probs=probs.tolist(), num_classes=int(probs.shape[0])))
        return json_response(ClassificationResponse(
            id=pooled.request_id, created=now(), model=ctx.response_model(req.model),
            data=data, usage=usage_of(pooled.prompt_tokens)))
