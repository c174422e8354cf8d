"""`POST /score` (`/v1/score`) and `POST /rerank` (`/v1/rerank`, `/v2/rerank`): how well
texts match, vLLM's rules.

A cross-encoder (a classification model) reads each pair joined as its tokenizer joins a
text pair (BERT: token types 1 on the second segment) and answers its activated logit (the
sigmoid of a single one); an embedding model embeds both sides and answers the cosine.
`/score` pairs `text_1` with `text_2`: one against many when `text_1` is one text, pairwise
for lists of one length; `/rerank` scores the query against each document and answers them by
decreasing relevance (Jina's and Cohere's shape), the first `top_n`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from ringserve.config import PoolerConfig
from ringserve.engine.frontend.pooling_inputs import cosine_similarity, plan_inputs
from ringserve.http.context import AppContext, request_id_of
from ringserve.http.errors import bad_request
from ringserve.http.pooling.inputs import pair_inputs, pooler_of, token_inputs
from ringserve.http.pooling.protocol import RerankRequest, ScoreRequest, parse_body
from ringserve.http.pooling.responses import (
    RerankDocument,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreResponse,
    now,
    response_id,
    usage_of,
)
from ringserve.http.pooling.runner import DISCONNECTED, run_plans
from ringserve.http.responses import json_response
from ringserve.pooling_params import PoolingParams


@dataclass(frozen=True)
class Scored:
    """The scores of pairs, in pair order, and the prompt tokens they took."""

    scores: list[float]
    prompt_tokens: int


@dataclass(frozen=True)
class ScoreCall:
    """One scoring job: what is scored against what, and how the messages name it.

    Attributes:
        firsts, seconds: the pairs' texts (`firsts` one text: against every second).
        first_field, second_field: the request fields they came from.
        noun: what one pair is called in messages ("pair", "document").
    """

    firsts: Sequence[str]
    seconds: Sequence[str]
    first_field: str
    second_field: str
    noun: str


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> tuple[list[str], list[str]]:
    """`text_1` and `text_2` as lists, vLLM's rules: one first text goes with every second
    one, else the lists pair up one to one.

    Raises:
        ValueError: an empty list, or lists of different lengths with more than one first
            text (naming text_1 / text_2).
    """
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts:
        raise ValueError("text_1: got an empty list; allowed: a text or a non-empty list")
    if not seconds:
        raise ValueError("text_2: got an empty list; allowed: a text or a non-empty list")
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise ValueError(f"text_1: {len(firsts)} texts against {len(seconds)} in text_2; "
                         "allowed: one text_1 (scored against every text_2) or lists of "
                         "the same length (scored pairwise)")
    return firsts, seconds


class Scoring:
    """The score and rerank routes."""

    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx

    async def _scores(self, request: Request, call: ScoreCall, rid: str, *,
                      truncate_prompt_tokens: int | None, activation: bool | None,
                      priority: int) -> Scored | None:
        pooler = pooler_of(self.ctx, "scores")
        if pooler.convert == "classify":
            return await self._cross_encoder(request, call, rid, pooler, priority=priority,
                                             truncate_prompt_tokens=truncate_prompt_tokens,
                                             activation=activation)
        return await self._cosine(request, call, rid, pooler, priority=priority,
                                  truncate_prompt_tokens=truncate_prompt_tokens)

    async def _cross_encoder(self, request: Request, call: ScoreCall, rid: str,
                             pooler: PoolerConfig, *, truncate_prompt_tokens: int | None,
                             activation: bool | None, priority: int) -> Scored | None:
        firsts = list(call.firsts) * len(call.seconds) if len(call.firsts) == 1 \
            else list(call.firsts)
        pairs = await pair_inputs(self.ctx, firsts, call.seconds, field=call.second_field,
                                  noun=call.noun, truncate_prompt_tokens=truncate_prompt_tokens)
        params = PoolingParams(task="score", activation=activation)
        plans = plan_inputs(pairs, params, pooler, field=call.second_field, noun=call.noun)
        outputs = await run_plans(self.ctx.engine, plans, rid, priority=priority,
                                  receive=request.receive)
        if outputs is None:
            return None
        if outputs and outputs[0].shape[0] != 1:
            raise bad_request(f"model: this classifier has {outputs[0].shape[0]} labels; "
                              "scores need a cross-encoder with one", "model")
        return Scored([float(out[0]) for out in outputs],
                      sum(plan.num_tokens for plan in plans))

    async def _cosine(self, request: Request, call: ScoreCall, rid: str, pooler: PoolerConfig,
                      *, truncate_prompt_tokens: int | None, priority: int) -> Scored | None:
        ctx = self.ctx
        first_ids = await token_inputs(ctx, call.firsts, field=call.first_field,
                                       truncate_prompt_tokens=truncate_prompt_tokens)
        second_ids = await token_inputs(ctx, call.seconds, field=call.second_field,
                                        noun=call.noun,
                                        truncate_prompt_tokens=truncate_prompt_tokens)
        params = PoolingParams(task="embed")
        plans = (plan_inputs(first_ids, params, pooler, field=call.first_field)
                 + plan_inputs(second_ids, params, pooler, field=call.second_field,
                               noun=call.noun))
        outputs = await run_plans(ctx.engine, plans, rid, priority=priority,
                                  receive=request.receive)
        if outputs is None:
            return None
        n = len(first_ids)
        firsts, seconds = outputs[:n], outputs[n:]
        scores = [cosine_similarity(firsts[0 if n == 1 else j], second)
                  for j, second in enumerate(seconds)]
        return Scored(scores, sum(plan.num_tokens for plan in plans))

    async def score(self, request: Request) -> Response:
        """`POST /score`."""
        ctx = self.ctx
        req = await parse_body(ctx, request, ScoreRequest, "/score")
        ctx.check_model(req.model)
        pooler_of(ctx, "/score")
        firsts, seconds = score_pairs(req.text_1, req.text_2)
        rid = response_id("score", request_id_of(request, req.request_id))
        scored = await self._scores(request, ScoreCall(firsts, seconds, "text_1", "text_2",
                                                       "pair"), rid,
                                    truncate_prompt_tokens=req.truncate_prompt_tokens,
                                    activation=req.activation, priority=req.priority)
        if scored is None:
            return Response(status_code=DISCONNECTED)
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scored.scores)]
        return json_response(ScoreResponse(
            id=rid, created=now(), model=ctx.response_model(req.model), data=data,
            usage=usage_of(scored.prompt_tokens)))

    async def rerank(self, request: Request) -> Response:
        """`POST /rerank`."""
        ctx = self.ctx
        req = await parse_body(ctx, request, RerankRequest, "/rerank")
        ctx.check_model(req.model)
        pooler_of(ctx, "/rerank")
        if not req.documents:
            raise bad_request("documents: got an empty list; allowed: at least one document",
                              "documents")
        if req.top_n is not None and req.top_n < 0:
            raise bad_request(f"top_n: got {req.top_n}, allowed: 0 or more (0: every "
                              "document)", "top_n")
        rid = response_id("rerank", request_id_of(request, req.request_id))
        scored = await self._scores(request, ScoreCall([req.query], req.documents, "query",
                                                       "documents", "document"), rid,
                                    truncate_prompt_tokens=req.truncate_prompt_tokens,
                                    activation=req.activation, priority=req.priority)
        if scored is None:
            return Response(status_code=DISCONNECTED)
        order = sorted(range(len(req.documents)), key=lambda i: -scored.scores[i])
        if req.top_n:
            order = order[:req.top_n]
        results = [RerankResult(index=i, relevance_score=scored.scores[i],
                                document=(RerankDocument(text=req.documents[i])
                                          if req.return_documents else None))
                   for i in order]
        return json_response(RerankResponse(
            id=rid, model=ctx.response_model(req.model),
            usage=RerankUsage(total_tokens=scored.prompt_tokens), results=results))
