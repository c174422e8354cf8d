"""Control routes (admin key): sleep, wake_up, is_sleeping, reset_prefix_cache, and elastic
data parallelism (scale_elastic_dp, is_scaling_elastic_dp).

Each calls the engine cores' utility of the same name (`AsyncLLM.call_utility`). Parameters
come, as in vLLM, from the query string (`/sleep?level=1`) or a JSON body (`{"level": 2}`); a
value a core refuses (a sleep level other than 1 or 2, sleeping with requests in flight) is a
400 with the core's message. Pause and resume (`/pause?mode=abort|keep|wait`, default abort,
as vLLM's) are with the other routes an RL trainer drives, in `ringserve.http.rl_routes`.

`POST /scale_elastic_dp` (`{"new_data_parallel_size": N, "drain_timeout": seconds}`, the body
of vLLM's `/scale_elastic_ep`; drain_timeout defaults to 120) runs both phases of
`AsyncLLM.scale_elastic_dp` and answers `{"message": "Scaled to N data parallel engines"}`
once routing has switched. A bad body or a refused scale is a 400 that says why, another scale
under way a 409, a scale-down whose leaving cores did not finish their requests in time a 408
(rolled back), a new core that did not start a 500 with its reason (rolled back).
`/is_scaling_elastic_dp` (GET or POST) answers `{"is_scaling_elastic_dp": bool}`.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ringserve.engine.cluster.elastic_dp import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DrainTimeoutError,
    ScaleFailedError,
    ScaleInProgressError,
)
from ringserve.http.context import TOO_DEEP, AppContext
from ringserve.http.errors import APIError, bad_request
from ringserve.http.responses import json_response

ADMIN_PATHS = ("/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache",
               "/scale_elastic_dp", "/is_scaling_elastic_dp")


class ScaleBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The body of `POST /scale_elastic_dp`."""

    new_data_parallel_size: int
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S


async def _param(request: Request, name: str) -> Any:
    """A parameter from the query string, else from a JSON object body; None if absent."""
    if name in request.query_params:
        return request.query_params[name]
    body = await request.body()
    if not body:
        return None
    try:
        values = msgspec.json.decode(body, type=dict[str, Any])
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise bad_request(f"Invalid request body: {exc} (expected a JSON object)") from None
    except RecursionError:
        raise bad_request(TOO_DEEP) from None
    return values.get(name)


class Admin:
    """The control routes."""

    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx

    async def _call(self, method: str, *args: Any) -> list[Any]:
        return await self.ctx.engine.call_utility(method, *args)

    async def sleep(self, request: Request) -> Response:
        """Free device memory: level 1 the KV cache, level 2 also the weights."""
        raw = await _param(request, "level")
        try:
            level = 1 if raw is None else int(raw)
        except (TypeError, ValueError):
            raise bad_request(f"level: got {raw!r}, allowed: 1 or 2", "level") from None
        if level not in (1, 2):  # checked here too: a huge int would not even reach a core
            raise bad_request(f"sleep level: got {level!r}, allowed: 1 (KV cache) or 2 "
                              "(+ weights)", "level")
        await self._call("sleep", level)
        return Response(status_code=200)

    async def wake_up(self, request: Request) -> Response:
        """Undo sleep."""
        await self._call("wake_up")
        return Response(status_code=200)

    async def is_sleeping(self, request: Request) -> Response:
        """`{"is_sleeping": bool}` (any core asleep)."""
        levels = await self._call("is_sleeping")
        return json_response({"is_sleeping": any(levels)})

    async def reset_prefix_cache(self, request: Request) -> Response:
        """Drop cached prefix blocks; `{"success": false}` when some are still in use."""
        results = await self._call("reset_prefix_cache")
        return json_response({"success": all(bool(r) for r in results)})

    async def scale_elastic_dp(self, request: Request) -> Response:
        """Scale the engine cores to `new_data_parallel_size` (see the module docstring)."""
        body = await self.ctx.parse(request, ScaleBody)
        size = body.new_data_parallel_size
        try:
            await self.ctx.engine.scale_elastic_dp(size, body.drain_timeout)
        except ScaleInProgressError as exc:
            raise APIError(409, str(exc)) from None
        except DrainTimeoutError as exc:
            raise APIError(408, str(exc), "drain_timeout") from None
        except ScaleFailedError as exc:
            raise APIError(500, f"Scale failed: {exc}") from None
        return json_response({"message": f"Scaled to {size} data parallel engines"})

    async def is_scaling_elastic_dp(self, request: Request) -> Response:
        """`{"is_scaling_elastic_dp": bool}`."""
        return json_response({"is_scaling_elastic_dp": self.ctx.engine.is_scaling_elastic_dp})

    def routes(self, wrap: Any) -> list[Route]:
        """The routes, each endpoint passed through `wrap` (the app's error guard)."""
        return [
            Route("/sleep", wrap(self.sleep), methods=["POST"]),
            Route("/wake_up", wrap(self.wake_up), methods=["POST"]),
            Route("/is_sleeping", wrap(self.is_sleeping), methods=["GET"]),
            Route("/reset_prefix_cache", wrap(self.reset_prefix_cache), methods=["POST"]),
            Route("/scale_elastic_dp", wrap(self.scale_elastic_dp), methods=["POST"]),
            Route("/is_scaling_elastic_dp", wrap(self.is_scaling_elastic_dp),
                  methods=["GET", "POST"]),
        ]
