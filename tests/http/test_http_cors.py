"""vLLM's serving flags through the ASGI app: CORS (preflight and simple requests), several
served model names, `--root-path`, and `--metrics-prefix vllm` (null model, one engine for
every app)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from http_app_harness import BASE_URL, error_of, make_engine
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.http.app import RootPathMiddleware, build_app
from ringserve.http.settings import ServerState, ServeSettings

KEY = {"Authorization": "Bearer sk-user"}
PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@asynccontextmanager
async def client(engine: AsyncLLM, settings: ServeSettings) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client on a fresh app over `engine`."""
    app = build_app(engine, settings, ServerState(ready=True))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE_URL,
                                 timeout=30) as http:
        yield http


async def _cors_defaults(engine: AsyncLLM) -> None:
    """vLLM's defaults: any origin, method and header; no credentials. Preflights need no
    key, and a 401 still carries the CORS header a browser needs to read it."""
    async with client(engine, ServeSettings(served_model_name="m", api_key="sk-user")) as http:
        r = await http.options("/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert r.headers["access-control-allow-headers"] == "authorization, content-type"
        assert "access-control-allow-credentials" not in r.headers
        r = await http.get("/v1/models", headers={"Origin": "https://app.example", **KEY})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = await http.get("/v1/models", headers={"Origin": "https://app.example"})
        assert error_of(r, 401) and r.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-origin" not in (await http.get("/health")).headers


async def _cors_restricted(engine: AsyncLLM) -> None:
    settings = ServeSettings(served_model_name="m", allowed_origins=("https://app.example",),
                             allowed_methods=("GET", "POST"), allowed_headers=("content-type",),
                             allow_credentials=True)
    async with client(engine, settings) as http:
        r = await http.options("/v1/completions", headers={
            **PREFLIGHT, "Access-Control-Request-Headers": "content-type"})
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert r.headers["access-control-allow-credentials"] == "true"
        assert set(r.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
        for bad in ({"Origin": "https://evil.example"},
                    {"Access-Control-Request-Method": "DELETE"},
                    {"Access-Control-Request-Headers": "x-secret"}):
            r = await http.options("/v1/completions", headers={**PREFLIGHT, **bad})
            assert r.status_code == 400, bad
        r = await http.get("/v1/models", headers={"Origin": "https://app.example"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert r.headers["access-control-allow-credentials"] == "true"
        r = await http.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


async def _served_names(engine: AsyncLLM) -> None:
    """Every name is listed and served; responses echo the name the request used."""
    settings = ServeSettings(served_model_name="first", served_model_aliases=("second", "gpt-4"))
    async with client(engine, settings) as http:
        listed = (await http.get("/v1/models")).json()["data"]
        assert [card["id"] for card in listed] == ["first", "second", "gpt-4"]
        assert {card["root"] for card in listed} == {"first"}
        for name in ("first", "second", "gpt-4"):
            r = await http.post("/v1/completions",
                                json={"model": name, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == name, r.text
            r = await http.post("/v1/chat/completions", json={
                "model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200 and r.json()["model"] == name, r.text
        r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.json()["model"] == "first"
        r = await http.post("/v1/completions", json={"model": "third", "prompt": "Hi"})
        assert error_of(r, 404)["message"] == "The model `third` does not exist."
        r = await http.post("/tokenize", json={"model": "second", "prompt": "Hi"})
        assert r.status_code == 200


async def _root_path(engine: AsyncLLM) -> None:
    """Routes match under the prefix and, from a proxy that strips it, without; the key
    checks see the same paths (a control route under the prefix is still a control route)."""
    settings = ServeSettings(served_model_name="m", api_key="sk-user", root_path="/llm")
    async with client(engine, settings) as http:
        for path in ("/llm/v1/models", "/v1/models"):
            r = await http.get(path, headers=KEY)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "m", path
        assert (await http.get("/llm/health")).status_code == 200  # open, as /health
        assert error_of(await http.get("/llm/v1/models"), 401)
        assert error_of(await http.post("/llm/sleep", headers=KEY), 403)  # needs the admin key
        assert error_of(await http.get("/llm/nothing-here", headers=KEY), 404)
        r = await http.post("/llm/v1/completions", headers=KEY,
                            json={"model": "m", "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 200, r.text


async def _metrics_prefix(engine: AsyncLLM) -> None:
    async with client(engine, ServeSettings(served_model_name="m")) as http:
        await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    async with client(engine, ServeSettings(served_model_name="m",
                                            metrics_prefix="vllm")) as http:
        text = (await http.get("/metrics")).text
    names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_success_total"):
        assert name in names, name
    assert not [n for n in names if n.startswith("ringserve:")]
    assert "vllm:prompt_tokens_total{" in text and 'model_name="' in text


@pytest.mark.slow
async def test_vllm_serving_flags(tiny_llama_dir: Path) -> None:
    async with make_engine(tiny_llama_dir) as engine:
        await _cors_defaults(engine)
        await _cors_restricted(engine)
        await _served_names(engine)
        await _root_path(engine)
        await _metrics_prefix(engine)


async def test_root_path_reaches_urls_built_from_the_request() -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        seen.append(str(request.base_url))  # what url_for and redirects build on
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    transport = httpx.ASGITransport(app=RootPathMiddleware(app, root_path="/llm"))
    async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as http:
        await http.get("/llm/v1/models")
    assert seen == [f"{BASE_URL}/llm/"]
