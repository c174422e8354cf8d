"""The ASGI app: OpenAI-compatible routes over a running AsyncLLM (Starlette on trio).

`build_app(engine, settings, state)` is what `ringserve serve` hands to hypercorn. The server
owns the engine's lifecycle and the `ServerState` flags; the app only calls the engine and
reads the flags: generation routes answer 503 while draining (or before the engine is ready)
and count themselves in `state.in_flight` until their response has been sent (a stream until
its last event or its client's disconnect), so the drain can wait on `state.idle`.

Routes: POST /v1/completions, POST /v1/chat/completions, the pooling routes of
`ringserve.http.pooling` (POST /v1/embeddings, /pooling, /classify, /score, /rerank and their
aliases; a server serves either these or the generation routes, and answers the other
kind with a 400), the agents' routes of
`ringserve.http.agents` (POST /v1/responses and its GET / DELETE / cancel / input_items,
POST /v1/messages and /v1/messages/count_tokens), GET /v1/models, GET /health,
GET /version, GET /metrics, POST /tokenize, POST /detokenize, the control routes of
`ringserve.http.admin`, the RL trainer's of `ringserve.http.rl_routes` (pause / resume,
weight updates) and those of `ringserve.http.fault_tolerance` (all with the admin key).
`/health` is 503 while the engine starts, drains, is dead or any core recovers from a fault.
Every error is OpenAI's error body (`ringserve.http.errors`), Anthropic's on the Messages
routes (`render_error`); keys are
checked by `ringserve.http.auth`; bodies over `max_request_body_bytes` get 413
(`ringserve.http.body_limit`). Outermost, as in vLLM: the `--root-path` prefix becomes the
ASGI root_path (the router then serves `/PREFIX/v1/...` and, from a proxy that strips it,
`/v1/...`), and Starlette's CORSMiddleware answers preflights and tags responses with the
`--allowed-origins` / `-methods` / `-headers` / `--allow-credentials` policy. `/v1/models`
lists every served name; `/metrics` names its families by `--metrics-prefix`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

import ringserve
from ringserve import envs
from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.engine.metrics.prometheus import prefixed_registry
from ringserve.http.admin import ADMIN_PATHS, Admin
from ringserve.http.agents.messages_errors import anthropic_response, is_messages_path
from ringserve.http.agents.messages_route import Messages
from ringserve.http.agents.responses_route import Responses
from ringserve.http.auth import AuthMiddleware, route_path
from ringserve.http.body_limit import BodyLimitMiddleware
from ringserve.http.chat import Chat
from ringserve.http.completions import Completions
from ringserve.http.context import AppContext, Endpoint
from ringserve.http.errors import (
    EXCEPTION_HANDLERS,
    APIError,
    ErrorRenderer,
    error_from_exception,
    openai_error_response,
)
from ringserve.http.fault_tolerance import FAULT_TOLERANCE_PATHS, FaultTolerance
from ringserve.http.lora_routes import LORA_PATHS, LoRARoutes
from ringserve.http.pooling.routes import pooling_routes
from ringserve.http.responses import ModelCard, ModelList, json_response
from ringserve.http.rl_routes import RL_PATHS, RLRoutes
from ringserve.http.settings import ServerState, ServeSettings
from ringserve.http.streaming import SSEResponse
from ringserve.http.tokenize import Tokenization

logger = logging.getLogger(__name__)


OPEN_PATHS = ("/health", "/version", "/metrics")


class RootPathMiddleware:
    """Sets the ASGI `root_path` of every request to `--root-path` (as FastAPI's root_path
    does for vLLM), so routes match under the prefix and URLs built from a request carry it.

    Args:
        app: the wrapped ASGI app.
        root_path: "" (nothing to do) or "/a/b".
    """

    def __init__(self, app: ASGIApp, *, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.root_path and scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


def render_error(path: str, error: APIError, headers: Mapping[str, str] | None = None) -> Response:
    """An error in the shape of the route it answers: Anthropic's on the Messages routes,
    OpenAI's everywhere else (`path` as the router matches it)."""
    if is_messages_path(path):
        return anthropic_response(error, headers)
    return openai_error_response(path, error, headers)


def _guard(ctx: AppContext, handler: Endpoint, *, generation: bool = False,
           pooling: bool = False,
           render: ErrorRenderer = openai_error_response) -> Endpoint:
    """Map engine and validation errors to responses (in the shape `render` gives); for
    generation routes (and the pooling routes, `pooling=True`, which count as generation)
    also refuse a route of the other runner (400), refuse new work while draining and keep
    the in-flight count until the response is done."""
    generation = generation or pooling

    async def endpoint(request: Request) -> Response:
        handed_off = False
        try:
            if generation:
                ctx.check_runner(pooling)
                ctx.check_accepting()
                ctx.state.enter()
            try:
                response = await handler(request)
                if generation and isinstance(response, SSEResponse):
                    response.on_close = ctx.state.leave  # runs when the stream ends
                    handed_off = True
            finally:
                if generation and not handed_off:
                    ctx.state.leave()
        except Exception as exc:
            error = error_from_exception(exc)
            if error is None:
                raise  # a bug: Starlette answers 500 and logs it
            response = render(route_path(request.scope), error, None)
        if ctx.settings.enable_log_requests:
            logger.info("%s %s -> %d", request.method, request.url.path, response.status_code)
        return response

    return endpoint


def build_app(engine: AsyncLLM, settings: ServeSettings, state: ServerState) -> Starlette:
    """The OpenAI-compatible Starlette app over `engine`.

    Args:
        engine: a started AsyncLLM (the server runs it; the app never starts or stops it).
        settings: the serving settings (model name, keys, chat template, body limit).
        state: the shared readiness / draining / in-flight state.
    """
    ctx = AppContext(engine, settings, state)

    async def models(request: Request) -> Response:
        cards = [ModelCard(id=name, created=ctx.created, root=ctx.model_name,
                           max_model_len=ctx.max_model_len)
                 for name in settings.served_model_names]
        # LoRA adapters: root is the adapter's path, parent the base model (vLLM's cards).
        cards += [ModelCard(id=lora.lora_name, created=ctx.created, root=lora.lora_path,
                            parent=ctx.model_name, max_model_len=ctx.max_model_len)
                  for lora in ctx.lora_modules.values()]
        return json_response(ModelList(data=cards))

    async def health(request: Request) -> Response:
        if not state.ready:
            return APIError(503, "The engine is still starting").response()
        if state.draining:
            return APIError(503, "The server is shutting down").response()
        if not engine.is_running:
            return APIError(503, "The engine is not running").response()
        if not engine.is_healthy:
            return APIError(503, "The engine is recovering from a fault").response()
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return json_response({"version": ringserve.__version__})

    registry = prefixed_registry(settings.metrics_prefix)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    tokenization = Tokenization(ctx)
    routes = [
        Route("/v1/completions", _guard(ctx, Completions(ctx).create, generation=True),
              methods=["POST"]),
        Route("/v1/chat/completions", _guard(ctx, Chat(ctx).create, generation=True),
              methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", _guard(ctx, tokenization.tokenize), methods=["POST"]),
        Route("/detokenize", _guard(ctx, tokenization.detokenize), methods=["POST"]),
        *Responses(ctx).routes(
            lambda handler, generation=False: _guard(ctx, handler, generation=generation)),
        *Messages(ctx).routes(
            lambda handler, generation=False: _guard(ctx, handler, generation=generation,
                                                     render=render_error)),
        *Admin(ctx).routes(lambda handler: _guard(ctx, handler)),
        *RLRoutes(ctx).routes(lambda handler: _guard(ctx, handler)),
        *FaultTolerance(ctx).routes(lambda handler: _guard(ctx, handler)),
        *pooling_routes(ctx, lambda handler: _guard(ctx, handler, pooling=True)),
    ]
    if envs.allow_runtime_lora_updating():
        routes += LoRARoutes(ctx).routes(lambda handler: _guard(ctx, handler))
    auth = Middleware(AuthMiddleware, api_keys=settings.api_keys,
                      admin_api_key=settings.admin_api_key, open_paths=OPEN_PATHS,
                      admin_paths=(*ADMIN_PATHS, *RL_PATHS, *FAULT_TOLERANCE_PATHS),
                      render=render_error, admin_if_set_paths=LORA_PATHS)
    limit = Middleware(BodyLimitMiddleware, limit=settings.max_request_body_bytes,
                       render=render_error)
    cors = Middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                      allow_methods=settings.allowed_methods,
                      allow_headers=settings.allowed_headers,
                      allow_credentials=settings.allow_credentials)
    root = Middleware(RootPathMiddleware, root_path=settings.root_path)
    # The first is outermost: a preflight is answered before any key check, and a 401 still
    # carries the CORS headers a browser needs to read it.
    return Starlette(routes=routes, middleware=[root, cors, auth, limit],
                     exception_handlers=EXCEPTION_HANDLERS)
