"""The routes an RL trainer drives (admin key), with the paths and bodies of vLLM's RLHF
router (`vllm serve`; TRL's vLLM client calls these): pause and resume, the four phases of a
weight update, the weight version, the world size, a description of the server and
`collective_rpc`.

    POST /pause          ?mode=abort|keep|wait (or a body)  {"status": "paused"}
    POST /resume                                            {"status": "resumed"}
    GET  /is_paused                                         {"is_paused": bool}
    POST /init_weight_transfer_engine  {"init_info": {...}}
                                                   {"message": "Weight transfer initialized"}
    POST /start_weight_update  [{"metadata": {...}, "is_checkpoint_format": true}]
                                                      {"message": "Weight update started"}
    POST /update_weights       {"update_info": {...}}  {"message": "Weights updated"}
    POST /finish_weight_update [{"weight_version": ...}]  {"message": "Weight update finished"}
    GET  /weight_info                                       {"weight_version": str | null}
    GET  /get_world_size ?include_dp=true|false             {"world_size": int}
    GET  /server_info                                       see `RLRoutes.server_info`
    POST /collective_rpc {"method", "args", "kwargs", "timeout"}  {"results": [...]}

Each calls the `AsyncLLM` method of the same name (`ringserve.engine.frontend.rl_api`), which returns
once every engine core has done it. Parameters follow ringserve's rule, also for these
vLLM-shaped routes: a body field or query parameter a route does not take is a 400 that names
it, a value of the wrong type a 400 with msgspec's path. A call an engine refuses (a weight
update on an engine started without `--weight-transfer-config`, metadata that does not match
the model, a method off collective_rpc's allow-list, a transport timeout) raises ValueError,
answered as a 400 carrying the engine's message. Bodies in brackets are optional.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import ringserve
from ringserve.engine.frontend.rl_api import check_checkpoint_format, check_pause_mode
from ringserve.http.context import TOO_DEEP, AppContext
from ringserve.http.errors import APIError, bad_request
from ringserve.http.responses import json_response

T = TypeVar("T", bound=msgspec.Struct)
V = TypeVar("V")

# Each route and its method (all of them need the admin key).
RL_ROUTES: dict[str, str] = {
    "/pause": "POST", "/resume": "POST", "/is_paused": "GET",
    "/init_weight_transfer_engine": "POST", "/start_weight_update": "POST",
    "/update_weights": "POST", "/finish_weight_update": "POST", "/weight_info": "GET",
    "/get_world_size": "GET", "/server_info": "GET", "/collective_rpc": "POST",
}
RL_PATHS = tuple(RL_ROUTES)

# A collective_rpc timeout past this is a mistake (and past ~292 years, threading's limit, a
# crash in the executor's wait).
MAX_RPC_TIMEOUT_S = 86_400.0

_PATH = re.compile(r"at `\$\.([^`]+)`")


class NoParams(msgspec.Struct, forbid_unknown_fields=True):
    """The parameters of a route that takes none."""


class PauseParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`/pause` (vLLM's query parameters; a JSON body may carry them too)."""

    mode: str | None = None
    wait_for_inflight_requests: bool = False
    clear_cache: bool = True


class WorldSizeParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`/get_world_size`."""

    include_dp: bool = True


class InitBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`/init_weight_transfer_engine`: the transport's init info (required)."""

    init_info: dict[str, Any] | None = None


class StartBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`/start_weight_update` (ringserve's extension; vLLM sends no body): the update's
    `{"names", "dtype_names", "shapes"}`, checked against the model before any byte moves."""

    metadata: dict[str, Any] | None = None
    # vLLM's flag: true (its default) is what ringserve does; false is refused by name.
    is_checkpoint_format: bool = True


class UpdateBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`/update_weights`: one bucket's transport info (required)."""

    update_info: dict[str, Any] | None = None


class FinishBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`/finish_weight_update`: the version the new weights are served as (None: unnamed)."""

    weight_version: str | None = None


class CollectiveRpcBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`/collective_rpc` (vLLM's body; keyword arguments are not supported)."""

    method: str | None = None
    args: list[Any] = msgspec.field(default_factory=list)
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    timeout: Annotated[float, msgspec.Meta(gt=0, le=MAX_RPC_TIMEOUT_S)] | None = None


def _unknown(name: str, kind: type[msgspec.Struct], what: str) -> APIError:
    fields = kind.__struct_fields__
    allowed = f"allowed: {', '.join(fields)}" if fields else "this route takes none"
    return bad_request(f"{name}: unknown {what}; {allowed}", name)


def _decode_object(body: bytes) -> dict[str, Any]:
    try:
        values: dict[str, Any] = msgspec.json.decode(body, type=dict[str, Any])
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise bad_request(f"Invalid request body: {exc} (expected a JSON object)") from None
    except RecursionError:  # msgspec's answer to deeply nested JSON
        raise bad_request(TOO_DEEP) from None
    return values


async def read_params(request: Request, kind: type[T], *, query: bool = False) -> T:
    """A route's parameters as `kind`: the fields of a JSON object body (an empty body is
    none), and with `query` also the query string's (converted from text; they win over the
    body's, as in `ringserve.http.admin`).

    Raises:
        APIError: 400 for a field or query parameter `kind` does not have (named), a body
            that is not a JSON object or nests too deeply, or a value of the wrong type.
    """
    fields = kind.__struct_fields__
    values: dict[str, Any] = {}
    body = await request.body()
    if body.strip():
        values = _decode_object(body)
        for name in values:
            if name not in fields:
                raise _unknown(name, kind, "field")
    for name, value in request.query_params.items():
        if not query or name not in fields:
            raise _unknown(name, kind, "query parameter")
        values[name] = value
    try:
        return msgspec.convert(values, kind, strict=not query)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc))
        raise bad_request(f"Invalid request: {exc}", match.group(1) if match else None) from None


def _sendable(name: str, value: V) -> V:
    """`value`, once it is known to cross to the engine cores (msgpack carries integers of
    at most 64 bits; a larger one would fail the call as a server error)."""
    try:
        msgspec.msgpack.encode(value)
    except OverflowError:
        raise bad_request(f"{name}: holds an integer outside the 64-bit range", name) from None
    return value


async def _engine(call: Awaitable[V]) -> V:
    """Await an engine call; a ValueError (a core refused it) is a 400 with its message.

    The app's guard would also answer 400, but would take the exception class that a core's
    failure message starts with (`WeightTransferError: ...`) for the offending field.
    """
    try:
        return await call
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def _required(name: str, value: dict[str, Any] | None) -> dict[str, Any]:
    if value is None:
        raise bad_request(f"Missing '{name}' in request body", name)
    return _sendable(name, value)


def _message(text: str) -> Response:
    return json_response({"message": text})


class RLRoutes:
    """The RL trainer's routes."""

    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx

    async def pause(self, request: Request) -> Response:
        """Stop generating; `{"status": "paused"}` once every core has.

        Parameters (query string, or a JSON body):
            mode: "abort" (default, as vLLM's: every request in flight ends now with finish
                reason "abort"), "keep" (they stay and continue after /resume) or "wait"
                (nothing new is scheduled; answers once those in flight have finished).
            wait_for_inflight_requests: vLLM's deprecated spelling of mode "wait"; true with
                another mode is a 400.
            clear_cache: vLLM's deprecated flag, accepted and ignored: clearing the cache is
                for KV of old weights, and the engine already drops its prefix cache (and
                recomputes the KV it keeps) when new weights are served; /reset_prefix_cache
                drops it on demand.
        """
        params = await read_params(request, PauseParams, query=True)
        mode = params.mode
        if params.wait_for_inflight_requests:
            if mode not in (None, "wait"):
                raise bad_request(f"wait_for_inflight_requests=true means mode 'wait'; it "
                                  f"conflicts with mode {mode!r}", "wait_for_inflight_requests")
            mode = "wait"
        try:
            mode = check_pause_mode("abort" if mode is None else mode)
        except ValueError as exc:
            raise bad_request(str(exc), "mode") from None
        await _engine(self.ctx.engine.pause(mode))
        return json_response({"status": "paused"})

    async def resume(self, request: Request) -> Response:
        """Undo /pause: kept requests continue, those that arrived meanwhile start."""
        await read_params(request, NoParams)
        await self.ctx.engine.resume()
        return json_response({"status": "resumed"})

    async def is_paused(self, request: Request) -> Response:
        """`{"is_paused": bool}` (any core paused)."""
        await read_params(request, NoParams)
        return json_response({"is_paused": await self.ctx.engine.is_paused()})

    async def init_weight_transfer_engine(self, request: Request) -> Response:
        """Open the channel from the trainer (`{"init_info": {...}}`, the transport's)."""
        body = await read_params(request, InitBody)
        await _engine(self.ctx.engine.init_weight_transfer_engine(
            _required("init_info", body.init_info)))
        return _message("Weight transfer initialized")

    async def start_weight_update(self, request: Request) -> Response:
        """Begin an update; an optional `{"metadata": {"names", "dtype_names", "shapes"}}`."""
        body = await read_params(request, StartBody)
        try:
            check_checkpoint_format(body.is_checkpoint_format)
        except ValueError as exc:
            raise bad_request(str(exc), "is_checkpoint_format") from None
        await _engine(self.ctx.engine.start_weight_update(_sendable("metadata", body.metadata)))
        return _message("Weight update started")

    async def update_weights(self, request: Request) -> Response:
        """Receive one bucket (`{"update_info": {...}}`, the transport's)."""
        body = await read_params(request, UpdateBody)
        await _engine(self.ctx.engine.update_weights(_required("update_info", body.update_info)))
        return _message("Weights updated")

    async def finish_weight_update(self, request: Request) -> Response:
        """Serve the new weights from the next step on, as `{"weight_version": ...}` (a
        string, or null / no body: unnamed)."""
        body = await read_params(request, FinishBody)
        await _engine(self.ctx.engine.finish_weight_update(body.weight_version))
        return _message("Weight update finished")

    async def weight_info(self, request: Request) -> Response:
        """`{"weight_version": ...}`: the version being served (null: the start-up weights)."""
        await read_params(request, NoParams)
        return json_response({"weight_version": await self.ctx.engine.get_weight_version()})

    async def get_world_size(self, request: Request) -> Response:
        """`{"world_size": N}`: tensor-parallel size times data-parallel size, or with
        `include_dp=false` the tensor-parallel size (the workers of one engine core)."""
        params = await read_params(request, WorldSizeParams, query=True)
        parallel = self.ctx.engine.config.parallel_config
        world_size = parallel.tensor_parallel_size
        if params.include_dp:
            world_size *= parallel.data_parallel_size
        return json_response({"world_size": world_size})

    async def server_info(self, request: Request) -> Response:
        """A description of the server (vLLM's route dumps its config; these keys are
        ringserve's):

        version: ringserve's version. model: the model directory. served_model_names: the
        names requests may use (the first is the primary one). architecture: the HF
        architecture. max_model_len, dtype. quantization: "int8" / "int4", "gguf" (a GGUF
        file's layers on the panels of their own codes), or null for float weights.
        tensor_parallel_size, data_parallel_size. device: "cpu" or "cuda".
        weight_transfer_config: `--weight-transfer-config` as an object (null: weight updates
        are off). weight_transfer_timeout_s: how long one update phase waits for the
        trainer. weight_version: the version being served (null: the start-up weights).
        is_paused: as /is_paused.
        """
        await read_params(request, NoParams)
        engine = self.ctx.engine
        config = engine.config
        model = config.model_config
        transfer = config.weight_transfer_config
        return json_response({
            "version": ringserve.__version__,
            "model": model.model,
            "served_model_names": list(self.ctx.settings.served_model_names),
            "architecture": model.architecture,
            "max_model_len": model.max_model_len,
            "dtype": model.dtype,
            "quantization": model.quantization,
            "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
            "data_parallel_size": config.parallel_config.data_parallel_size,
            "device": config.device_config.device,
            "weight_transfer_config": None if transfer is None else msgspec.to_builtins(transfer),
            "weight_transfer_timeout_s": config.weight_transfer_timeout_s,
            "weight_version": await engine.get_weight_version(),
            "is_paused": await engine.is_paused(),
        })

    async def collective_rpc(self, request: Request) -> Response:
        """Call an allow-listed worker method on every worker (core by core, rank order):
        `{"method": str, "args": [...], "timeout": seconds | null}` answers
        `{"results": [...]}`. `kwargs` is vLLM's field; only an empty one is accepted."""
        body = await read_params(request, CollectiveRpcBody)
        if body.method is None:
            raise bad_request("Missing 'method' in request body", "method")
        if body.kwargs:
            raise bad_request(f"kwargs are not supported (got {sorted(body.kwargs)}); pass "
                              "arguments in args", "kwargs")
        results = await _engine(self.ctx.engine.collective_rpc(
            body.method, _sendable("args", body.args), timeout=body.timeout))
        return json_response({"results": results})

    def routes(self, wrap: Any) -> list[Route]:
        """The routes, each endpoint passed through `wrap` (the app's error guard)."""
        endpoints = {
            "/pause": self.pause, "/resume": self.resume, "/is_paused": self.is_paused,
            "/init_weight_transfer_engine": self.init_weight_transfer_engine,
            "/start_weight_update": self.start_weight_update,
            "/update_weights": self.update_weights,
            "/finish_weight_update": self.finish_weight_update,
            "/weight_info": self.weight_info, "/get_world_size": self.get_world_size,
            "/server_info": self.server_info, "/collective_rpc": self.collective_rpc,
        }
        return [Route(path, wrap(endpoints[path]), methods=[method])
                for path, method in RL_ROUTES.items()]
