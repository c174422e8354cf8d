"""LoRA adapters loaded and unloaded at run time: `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter` (vLLM's routes and bodies).

Served only when `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (or `RINGSERVE_ALLOW_RUNTIME_LORA_UPDATING`)
is set and the engine has `--enable-lora`; behind `--admin-api-key` when one is set (else behind
the API key, as vLLM). A load checks the adapter's files and config off the event loop and
names it with a fresh `lora_int_id` (so a reload never reuses the old load's prefix-cache
blocks); an unload removes the name at once (new requests get 404) and tells every engine core,
whose workers drop the adapter once the requests running on it have finished. Both answer 200
with vLLM's plain-text message.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import count

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from ringserve.http.context import AppContext, Endpoint
from ringserve.http.errors import APIError, bad_request
from ringserve.lora_request import LoRARequest

__all__ = ["LORA_PATHS", "LoRARoutes"]

LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class LoadBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The body of `/v1/load_lora_adapter`."""

    lora_name: str
    lora_path: str


class UnloadBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The body of `/v1/unload_lora_adapter` (`lora_int_id` is accepted, as vLLM's)."""

    lora_name: str
    lora_int_id: int | None = None


class LoRARoutes:
    """The two routes over one app context."""

    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx
        start = max((m.lora_int_id for m in ctx.lora_modules.values()), default=0) + 1
        self._ids = count(start)

    def routes(self, wrap: Callable[[Endpoint], Endpoint]) -> list[Route]:
        """The routes, each wrapped by `wrap` (the app's error guard)."""
        return [Route("/v1/load_lora_adapter", wrap(self.load), methods=["POST"]),
                Route("/v1/unload_lora_adapter", wrap(self.unload), methods=["POST"])]

    def _lora_on(self) -> int:
        lora = self.ctx.engine.config.lora_config
        if lora is None:
            raise bad_request("LoRA is off: start the server with --enable-lora")
        return lora.max_lora_rank

    async def load(self, request: Request) -> Response:
        """Load an adapter under a new name."""
        max_rank = self._lora_on()
        body = await self.ctx.parse(request, LoadBody)
        if not body.lora_name or not body.lora_path:
            raise bad_request("lora_name and lora_path must be non-empty", "lora_name")
        if (body.lora_name in self.ctx.lora_modules
                or body.lora_name in self.ctx.settings.served_model_names):
            raise bad_request(f"The lora adapter '{body.lora_name}' has already been loaded.",
                              "lora_name")
        from ringserve.gpu.lora.adapter_config import read_adapter_config

        try:
            await trio.to_thread.run_sync(
                lambda: read_adapter_config(body.lora_path, max_lora_rank=max_rank))
        except ValueError as exc:
            raise bad_request(str(exc), "lora_path") from None
        self.ctx.lora_modules[body.lora_name] = LoRARequest(body.lora_name, next(self._ids),
                                                            body.lora_path)
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        """Unload an adapter by name (running requests on it finish first)."""
        self._lora_on()
        body = await self.ctx.parse(request, UnloadBody)
        lora = self.ctx.lora_modules.get(body.lora_name)
        if lora is None or (body.lora_int_id is not None
                            and body.lora_int_id != lora.lora_int_id):
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                           "lora_name")
        del self.ctx.lora_modules[body.lora_name]
        await self.ctx.engine.call_utility("remove_lora", lora.identity)
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
