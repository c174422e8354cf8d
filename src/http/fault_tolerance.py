"""Fault-tolerance routes (admin key), shaped like vLLM's so its tooling works.

* `POST /fault_tolerance/apply` with `{"instruction": "retry" | "abort", "params": {}}`
  answers 202 `{"request_id": ...}` and runs the instruction in the background
  (`AsyncLLM.submit_fault_instruction`); its outcome shows in the status below.
* `GET /fault_tolerance/status` answers `{"schema_version": 1, "total_engines": N,
  "engines": [{"id", "status", "fault_info", "last_ft_request_id", "ft_error"}]}`.

An unknown instruction or non-empty params is a 400 that says what is allowed.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ringserve.http.context import AppContext
from ringserve.http.responses import json_response

FAULT_TOLERANCE_PATHS = ("/fault_tolerance/apply", "/fault_tolerance/status")


class FaultInstructionBody(msgspec.Struct, forbid_unknown_fields=True):
    """The body of `POST /fault_tolerance/apply`."""

    instruction: str
    params: dict[str, Any] = {}


class FaultTolerance:
    """The fault-tolerance routes."""

    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx

    async def apply(self, request: Request) -> Response:
        """Start a fault instruction; 202 with its id."""
        body = await self.ctx.parse(request, FaultInstructionBody)
        request_id = self.ctx.engine.submit_fault_instruction(body.instruction, body.params)
        return json_response({"request_id": request_id}, status=202)

    async def status(self, request: Request) -> Response:
        """Every engine core's fault-tolerance state."""
        return json_response(self.ctx.engine.fault_status())

    def routes(self, wrap: Any) -> list[Route]:
        """The routes, each endpoint passed through `wrap` (the app's error guard)."""
        return [
            Route("/fault_tolerance/apply", wrap(self.apply), methods=["POST"]),
            Route("/fault_tolerance/status", wrap(self.status), methods=["GET"]),
        ]
