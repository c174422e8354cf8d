"""What every route needs: the engine, the settings, the shared state, and body decoding.

`AppContext` is built once by `build_app` and handed to the route classes. It decodes bodies
with msgspec (a decode error names the path and becomes a 400; `body_limit` makes an
oversized body a 413), checks the model name (404 when it is none of the served names;
responses echo the name the request used: `response_model`),
tokenizes (long texts in a worker thread, as AsyncLLM does), refuses generation while the
server drains or before the engine is ready (503), and refuses a route of the other runner
(400: generation on a pooling server, pooling on a generation one).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import Response

from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.http.errors import APIError, bad_request, error_from_exception
from ringserve.http.settings import ServerState, ServeSettings
from ringserve.lora_request import LoRARequest

T = TypeVar("T")

Endpoint = Callable[[Request], Awaitable[Response]]


class Guard(Protocol):
    """The app's wrapper of a route's endpoint: engine and validation errors mapped to
    responses and, for a generation route (`generation=True`), new work refused while
    draining and the request counted in flight until its response is done."""

    def __call__(self, handler: Endpoint, generation: bool = False) -> Endpoint: ...

TOO_DEEP = "Invalid request body: JSON nested too deeply"

# Texts longer than this are tokenized in a worker thread (the same cut-off as AsyncLLM's).
_INLINE_TOKENIZE_CHARS = 2048


@dataclass
class AppContext:
    """The engine and settings behind the routes.

    Attributes:
        engine: the running AsyncLLM (its lifecycle belongs to the server).
        settings: the serving settings.
        state: readiness, draining and the in-flight count, shared with the server.
        tokenizer: the engine's tokenizer.
        max_model_len: the engine's context length.
        created: when the app was built (the `created` of `/v1/models`).
    """

    engine: AsyncLLM
    settings: ServeSettings
    state: ServerState
    tokenizer: Any = field(init=False)
    max_model_len: int = field(init=False)
    # LoRA adapters by name (`--lora-modules`, and those loaded at run time).
    lora_modules: dict[str, LoRARequest] = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.tokenizer = self.engine.get_tokenizer()
        self.lora_modules = {m.lora_name: m for m in self.settings.lora_modules}
        pooler = self.engine.config.pooler_config
        # A pooling model's length is its longest input (the engine's context holds one more
        # slot, for the token a pooling request books and never samples).
        self.max_model_len = (pooler.max_input_len if pooler is not None
                              else self.engine.config.model_config.max_model_len)

    @property
    def model_name(self) -> str:
        """The served model name."""
        return self.settings.served_model_name

    async def parse(self, request: Request, kind: type[T]) -> T:
        """Decode the JSON body as `kind`.

        Raises:
            APIError: 400 for malformed or too deeply nested JSON, or a field of the wrong
                type (path named).
            APIError: 413 from the body limit.
        """
        body = await request.body()
        if not body:
            raise bad_request("The request body is empty; expected a JSON object")
        try:
            return msgspec.json.decode(body, type=kind)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            error = error_from_exception(exc)
            assert error is not None
            raise error from None
        except RecursionError:  # msgspec's answer to deeply nested JSON
            raise bad_request(TOO_DEEP) from None

    def check_model(self, model: str | None) -> None:
        """Raises APIError 404 unless `model` is one of the served names, a LoRA adapter's
        name (`--lora-modules`, or loaded at run time), or omitted."""
        if (model is not None and model not in self.settings.served_model_names
                and model not in self.lora_modules):
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def response_model(self, model: str | None) -> str:
        """The `model` a response carries: the served name or adapter name the request used,
        else the first served name."""
        if model is not None and (model in self.settings.served_model_names
                                  or model in self.lora_modules):
            return model
        return self.model_name

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` selects (None: the base model)."""
        return self.lora_modules.get(model) if model is not None else None

    def check_runner(self, pooling: bool) -> None:
        """Raises APIError 400 when the route's kind is not the engine's runner: a
        generation route (`pooling=False`) on a pooling server, or a pooling route
        (embeddings, classification, scores) on a generation server (one runner per server,
        as vLLM)."""
        pooler = self.engine.config.pooler_config
        if pooling and pooler is None:
            raise APIError(400, f"The model `{self.model_name}` does not support pooling "
                           "(embeddings, classification, scores): it is a generation model; "
                           "serve a pooling model with --runner pooling", "model")
        if not pooling and pooler is not None:
            raise APIError(400, f"The model `{self.model_name}` is a pooling model "
                           f"(--runner pooling, --convert {pooler.convert}): it does not "
                           "generate text; use /v1/embeddings, /pooling, /classify, /score or "
                           "/rerank", "model")

    def check_accepting(self) -> None:
        """Raises APIError 503 while draining, before the engine is ready, once it died, or
        while it recovers from a fault."""
        if self.state.draining:
            raise APIError(503, "The server is shutting down and accepts no new requests")
        if not self.state.ready:
            raise APIError(503, "The engine is still starting")
        if self.engine.errored:
            raise APIError(503, "The engine is not available (it stopped)")
        if self.engine.recovering:
            raise APIError(503, "The engine is recovering from a fault; try again later")

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (off the event loop when it is long)."""
        def encode() -> list[int]:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

        if len(text) > _INLINE_TOKENIZE_CHARS:
            return await trio.to_thread.run_sync(encode)
        return encode()


def request_id_of(request: Request, given: str | None) -> str:
    """A request's id: the body's `request_id`, else `X-Request-Id`, else a fresh one."""
    return given or request.headers.get("x-request-id") or uuid.uuid4().hex
