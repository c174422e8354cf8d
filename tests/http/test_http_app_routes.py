"""Auth, health/draining, the small routes (models, version, metrics, tokenize, admin),
body limits, unknown routes, and a stream that fails mid-way (null model)."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio
from http_app_harness import MODEL, error_of, serving, sse_events
from prometheus_client.parser import text_string_to_metric_families

import ringserve
from ringserve.http.admin import ADMIN_PATHS
from ringserve.http.settings import ServeSettings

KEYS = ServeSettings(served_model_name=MODEL, api_key="sk-user", admin_api_key="sk-admin",
                     max_request_body_bytes=4096)
USER = {"Authorization": "Bearer sk-user"}
ADMIN = {"Authorization": "Bearer sk-admin"}


async def test_keys(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, settings=KEYS) as s:
        for path in ("/health", "/version", "/metrics"):
            assert (await s.http.get(path)).status_code == 200, path
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                             ("POST", "/detokenize")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, ADMIN,
                            {"Authorization": "sk-user"}):
                r = await s.http.request(method, path, headers=headers)
                assert error_of(r, 401)["type"] == "AuthenticationError", (path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
        r = await s.http.get("/v1/models", headers=USER)
        assert r.json()["data"][0]["id"] == MODEL
        assert r.json()["data"][0]["max_model_len"] == 512
        for path in ADMIN_PATHS:
            method = "GET" if path == "/is_sleeping" else "POST"
            assert (await s.http.request(method, path, headers=USER)).status_code == 401
            assert (await s.http.request(method, path)).status_code == 401
    async with serving(tiny_llama_dir) as s:  # no admin key: control routes are off
        for path in ADMIN_PATHS:
            method = "GET" if path == "/is_sleeping" else "POST"
            assert error_of(await s.http.request(method, path), 403)["message"].startswith(path)


async def test_small_routes_and_admin(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, settings=KEYS) as s:
        assert (await s.http.get("/version")).json() == {"version": ringserve.__version__}
        r = await s.http.get("/metrics")
        assert r.headers["content-type"].startswith("text/plain")
        assert list(text_string_to_metric_families(r.text))
        r = await s.http.post("/tokenize", headers=USER,
                              json={"prompt": "Hello there", "return_token_strs": True})
        tok = r.json()
        assert tok["tokens"] == s.engine.get_tokenizer()("Hello there").input_ids
        assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
        assert tok["max_model_len"] == 512
        r = await s.http.post("/detokenize", headers=USER, json={"tokens": tok["tokens"][1:]})
        assert r.json() == {"prompt": "Hello there"}
        r = await s.http.post("/detokenize", headers=USER, json={"tokens": [8000]})
        assert error_of(r, 400)["param"] == "tokens"

        assert (await s.http.post("/sleep?level=1", headers=ADMIN)).status_code == 200
        assert (await s.http.get("/is_sleeping", headers=ADMIN)).json() == {"is_sleeping": True}
        assert (await s.http.post("/wake_up", headers=ADMIN)).status_code == 200
        assert (await s.http.get("/is_sleeping", headers=ADMIN)).json() == {"is_sleeping": False}
        r = await s.http.post("/sleep", headers=ADMIN, json={"level": 3})
        assert "sleep level" in error_of(r, 400)["message"]
        assert (await s.http.post("/pause", headers=ADMIN, json={"mode": "keep"})).status_code == 200
        r = await s.http.post("/pause?mode=later", headers=ADMIN)
        assert "pause mode" in error_of(r, 400)["message"]
        assert (await s.http.post("/resume", headers=ADMIN)).status_code == 200
        r = await s.http.post("/reset_prefix_cache", headers=ADMIN)
        assert r.json() == {"success": True}
        r = await s.http.post("/v1/completions", headers=USER, json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text


async def test_admin_bodies_out_of_range_or_too_deep(tiny_llama_dir: Path) -> None:
    # Found by tests/http/test_http_fuzz.py: both were 500s (a level the wire cannot carry,
    # msgspec's RecursionError).
    settings = ServeSettings(served_model_name=MODEL, admin_api_key="sk-admin")
    async with serving(tiny_llama_dir, settings=settings) as s:
        r = await s.http.post("/sleep", headers=ADMIN, json={"level": 10**30})
        assert "sleep level" in error_of(r, 400)["message"]
        deep = b'{"mode": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        r = await s.http.post("/pause", headers=ADMIN, content=deep)
        assert "nested too deeply" in error_of(r, 400)["message"]
        assert (await s.http.get("/is_sleeping", headers=ADMIN)).json() == {"is_sleeping": False}


async def test_limits_unknown_routes_health_and_draining(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, settings=KEYS) as s:
        big = {"prompt": "x" * 5000}
        assert error_of(await s.http.post("/v1/completions", headers=USER, json=big), 413)

        async def chunks() -> object:
            for _ in range(10):
                yield b" " * 1000  # no Content-Length: the streamed length counts

        r = await s.http.post("/v1/completions", headers=USER, content=chunks())
        error_of(r, 413)
        assert error_of(await s.http.get("/v1/nothing", headers=USER), 404)["type"] == "NotFoundError"
        assert error_of(await s.http.get("/nothing"), 401)  # unknown paths need the key too
        error_of(await s.http.get("/v1/completions", headers=USER), 405)

        assert (await s.http.get("/health")).status_code == 200
        s.state.draining = True
        error_of(await s.http.get("/health"), 503)
        r = await s.http.post("/v1/completions", headers=USER, json={"prompt": "x"})
        assert "shutting down" in error_of(r, 503)["message"]
        s.state.draining = False
        s.state.ready = False
        error_of(await s.http.get("/health"), 503)
        s.state.ready = True


async def test_engine_death_mid_stream_is_an_error_chunk(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir) as s:
        body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
        result: list[httpx.Response] = []

        async def stream() -> None:
            result.append(await s.http.post("/v1/completions", json=body))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            while s.engine.output_processor.get_num_unfinished_requests() == 0:
                await trio.sleep(0.005)
            s.engine.shutdown()
        events = sse_events(result[0].text)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == 503
        assert s.state.in_flight == 0
        error_of(await s.http.get("/health"), 503)
        r = await s.http.post("/v1/completions", json={"prompt": "x"})
        assert error_of(r, 503)
