"""Helpers of the ASGI app tests: an engine on the tiny model, the app over it, and clients
(httpx through the ASGI transport, and the official openai client on top of it)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import trio
from starlette.applications import Starlette

from ringserve import EngineArgs
from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.http.app import build_app
from ringserve.http.settings import ServerState, ServeSettings

MODEL = "tiny"
BASE_URL = "http://test"


@dataclass
class Served:
    """A running engine, the app over it and an httpx client bound to the app."""

    engine: AsyncLLM
    state: ServerState
    app: Starlette
    http: httpx.AsyncClient

    def openai(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        """The official client, talking to the app through the ASGI transport."""
        return openai.AsyncOpenAI(base_url=f"{BASE_URL}/v1", api_key=api_key,
                                  http_client=self.http, max_retries=0)


def make_engine(model_dir: Path, executor: str = "null", **kw: Any) -> AsyncLLM:
    """An AsyncLLM on `model_dir` (the null model unless `executor="default"`)."""
    values: dict[str, Any] = {"model": str(model_dir), "device": "cpu",
                              "kv_cache_memory": 16 << 20, "max_model_len": 512, **kw}
    return AsyncLLM.from_engine_args(EngineArgs(**values), executor=executor)


@asynccontextmanager
async def serving(model_dir: Path, executor: str = "null", *, settings: ServeSettings | None = None,
                  **engine_kw: Any) -> AsyncIterator[Served]:
    """Run an engine and yield the app over it, marked ready, with a nursery for background
    responses (as the server's supervisor gives it)."""
    async with make_engine(model_dir, executor, **engine_kw) as engine, \
            trio.open_nursery() as background:
        state = ServerState(ready=True, background=background)
        app = build_app(engine, settings or ServeSettings(served_model_name=MODEL), state)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL,
                                     timeout=30) as http:
            yield Served(engine, state, app, http)
        background.cancel_scope.cancel()  # background responses still running


def sse_events(body: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded (`[DONE]` kept as the string)."""
    events: list[Any] = []
    for line in body.split("\n\n"):
        if not line.strip():
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI-shaped error of a response, after checking its status and shape."""
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    return error


async def drained(engine: AsyncLLM) -> dict[str, Any]:
    """The core's stats once no request is left in it (fails after ~4 s)."""
    for _ in range(200):
        stats = (await engine.call_utility("get_stats"))[0]
        if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0:
            return dict(stats)
        await trio.sleep(0.02)
    raise AssertionError(f"requests still in the core: {stats}")
