"""The pooling routes as `ringserve.http.app` mounts them (each behind the app's guard,
which counts them in flight, refuses them while draining, and refuses them with a 400 on a
generation server)."""

from __future__ import annotations

from collections.abc import Callable

from starlette.routing import Route

from ringserve.http.context import AppContext, Endpoint
from ringserve.http.pooling.classify import Classification
from ringserve.http.pooling.embeddings import Embeddings
from ringserve.http.pooling.score import Scoring

POOLING_PATHS = ("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                 "/v1/rerank", "/v2/rerank")


def pooling_routes(ctx: AppContext, guard: Callable[[Endpoint], Endpoint]) -> list[Route]:
    """Every pooling route (POST), each behind `guard`."""
    embeddings, scoring = Embeddings(ctx), Scoring(ctx)
    handlers: dict[str, Endpoint] = {
        "/v1/embeddings": embeddings.create,
        "/pooling": embeddings.pool,
        "/classify": Classification(ctx).create,
        "/score": scoring.score,
        "/v1/score": scoring.score,
        "/rerank": scoring.rerank,
        "/v1/rerank": scoring.rerank,
        "/v2/rerank": scoring.rerank,
    }
    return [Route(path, guard(handlers[path]), methods=["POST"]) for path in POOLING_PATHS]
