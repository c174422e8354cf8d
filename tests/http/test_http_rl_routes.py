"""The RL trainer's routes (`ringserve.http.rl_routes`: pause / resume, weight updates,
world size, server info, collective_rpc) and the weight versions on every response, over the
null model (and the real tiny model where workers must answer)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from http_app_harness import MODEL, Served, error_of, serving, sse_events

import ringserve
from ringserve.http.app import build_app
from ringserve.http.rl_routes import RL_ROUTES
from ringserve.http.settings import ServerState, ServeSettings

SETTINGS = ServeSettings(served_model_name=MODEL, api_key="sk-user", admin_api_key="sk-admin")
USER = {"Authorization": "Bearer sk-user"}
ADMIN = {"Authorization": "Bearer sk-admin"}
LONG = 1000  # tokens: ~0.25 s on the null model, far longer than a control call takes


def _stream_body(max_tokens: int) -> dict[str, Any]:
    return {"prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def _start(s: Served, nursery: trio.Nursery, body: dict[str, Any],
                 path: str = "/v1/completions") -> list[httpx.Response]:
    """POST `body` in the background; returns the list its response lands in, once the
    engine has the request."""
    result: list[httpx.Response] = []

    async def post() -> None:
        result.append(await s.http.post(path, headers=USER, json=body))

    nursery.start_soon(post)
    with trio.fail_after(10):
        while s.engine.output_processor.get_num_unfinished_requests() == 0:
            await trio.sleep(0.002)
    return result


def _ending(response: httpx.Response) -> tuple[str | None, int]:
    """A completion stream's last finish reason and its completion tokens (usage chunk)."""
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    reasons = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
    return reasons[-1], events[-2]["usage"]["completion_tokens"]


async def _is_paused(s: Served) -> bool:
    r = await s.http.get("/is_paused", headers=ADMIN)
    assert r.status_code == 200, r.text
    paused: bool = r.json()["is_paused"]
    return paused


async def test_routes_need_the_admin_key(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, settings=SETTINGS) as s:
        for path, method in RL_ROUTES.items():
            for headers in ({}, USER, {"Authorization": "Bearer wrong"}):
                r = await s.http.request(method, path, headers=headers)
                assert error_of(r, 401)["type"] == "AuthenticationError", (path, headers)
        # Without an admin key the routes are off (a second app over the same engine).
        app = build_app(s.engine, ServeSettings(served_model_name=MODEL), ServerState(ready=True))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as http:
            for path, method in RL_ROUTES.items():
                r = await http.request(method, path, headers=ADMIN)
                assert error_of(r, 403)["message"].startswith(f"{path} is disabled"), path


async def test_pause_resume_and_their_parameters(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, settings=SETTINGS) as s:
        assert not await _is_paused(s)
        r = await s.http.post("/pause", headers=ADMIN)
        assert r.status_code == 200 and r.json() == {"status": "paused"}
        assert await _is_paused(s)
        r = await s.http.post("/resume", headers=ADMIN)
        assert r.status_code == 200 and r.json() == {"status": "resumed"}
        assert not await _is_paused(s)
        for ok in ("?mode=keep", "?mode=wait", "?mode=abort&clear_cache=false",
                   "?wait_for_inflight_requests=true", "?wait_for_inflight_requests=true&mode=wait",
                   "?wait_for_inflight_requests=false&mode=keep"):
            assert (await s.http.post(f"/pause{ok}", headers=ADMIN)).json() == {"status": "paused"}
            assert (await s.http.post("/resume", headers=ADMIN, json={})).status_code == 200
        for body in ({"mode": "keep"}, {"mode": "wait", "clear_cache": True}):
            assert (await s.http.post("/pause", headers=ADMIN, json=body)).status_code == 200
            assert (await s.http.post("/resume", headers=ADMIN)).status_code == 200

        error = error_of(await s.http.post("/pause?mode=later", headers=ADMIN), 400)
        assert error["param"] == "mode" and "abort, keep, wait" in error["message"]
        error = error_of(await s.http.post("/pause", headers=ADMIN, json={"mode": 3}), 400)
        assert error["param"] == "mode"
        r = await s.http.post("/pause?wait_for_inflight_requests=true&mode=keep", headers=ADMIN)
        assert error_of(r, 400)["param"] == "wait_for_inflight_requests"
        r = await s.http.post("/pause?clear_cache=maybe", headers=ADMIN)
        assert error_of(r, 400)["param"] == "clear_cache"
        for r in (await s.http.post("/pause?flush=1", headers=ADMIN),
                  await s.http.post("/pause", headers=ADMIN, json={"mode": "keep", "flush": 1}),
                  await s.http.post("/resume", headers=ADMIN, json={"flush": 1}),
                  await s.http.get("/is_paused?flush=1", headers=ADMIN)):
            error = error_of(r, 400)
            assert error["param"] == "flush" and "flush: unknown" in error["message"]
        r = await s.http.post("/pause", headers=ADMIN, content=b"[1]")
        assert "expected a JSON object" in error_of(r, 400)["message"]
        assert not await _is_paused(s)  # none of the refused calls paused


async def test_pause_default_aborts_a_stream_in_flight(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, settings=SETTINGS, max_model_len=2048) as s:
        async with trio.open_nursery() as nursery:
            stream = await _start(s, nursery, _stream_body(LONG))
            assert (await s.http.post("/pause", headers=ADMIN)).json() == {"status": "paused"}
        reason, tokens = _ending(stream[0])
        assert reason == "abort" and tokens < LONG
        assert await _is_paused(s)
        # Held while paused, served after /resume.
        async with trio.open_nursery() as nursery:
            late = await _start(s, nursery, {"prompt": "x", "max_tokens": 3})
            await trio.sleep(0.05)
            assert not late
            assert (await s.http.post("/resume", headers=ADMIN)).status_code == 200
        assert late[0].json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
async def test_pause_keep_then_resume_continues_a_stream(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, settings=SETTINGS, max_model_len=2048) as s:
        async with trio.open_nursery() as nursery:
            stream = await _start(s, nursery, _stream_body(LONG))
            r = await s.http.post("/pause?mode=keep", headers=ADMIN)
            assert r.json() == {"status": "paused"}
            await trio.sleep(0.1)
            assert not stream  # held, not ended
            assert s.engine.output_processor.get_num_unfinished_requests() == 1
            assert (await s.http.post("/resume", headers=ADMIN)).json() == {"status": "resumed"}
        assert _ending(stream[0]) == ("length", LONG)


@pytest.mark.slow
async def test_pause_wait_returns_once_the_stream_finished(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, settings=SETTINGS, max_model_len=2048) as s:
        async with trio.open_nursery() as nursery:
            stream = await _start(s, nursery, _stream_body(LONG))
            r = await s.http.post("/pause?wait_for_inflight_requests=true", headers=ADMIN)
            assert r.json() == {"status": "paused"}
            assert s.engine.output_processor.get_num_unfinished_requests() == 0
        assert _ending(stream[0]) == ("length", LONG)
        assert await _is_paused(s)


@pytest.mark.slow
async def test_world_size_server_info_and_weight_info(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, settings=SETTINGS, tensor_parallel_size=2,
                       data_parallel_size=2) as s:
        for query, size in (("", 4), ("?include_dp=true", 4), ("?include_dp=false", 2)):
            r = await s.http.get(f"/get_world_size{query}", headers=ADMIN)
            assert r.json() == {"world_size": size}, query
        r = await s.http.get("/get_world_size?include_dp=maybe", headers=ADMIN)
        assert error_of(r, 400)["param"] == "include_dp"
        r = await s.http.get("/get_world_size?dp=1", headers=ADMIN)
        assert error_of(r, 400)["param"] == "dp"

        assert (await s.http.get("/weight_info", headers=ADMIN)).json() == {"weight_version": None}
        info = (await s.http.get("/server_info", headers=ADMIN)).json()
        assert info == {
            "version": ringserve.__version__, "model": s.engine.config.model_config.model,
            "served_model_names": [MODEL], "architecture": "LlamaForCausalLM",
            "max_model_len": 512, "dtype": "float32", "quantization": None,
            "tensor_parallel_size": 2, "data_parallel_size": 2, "device": "cpu",
            "weight_transfer_config": None, "weight_transfer_timeout_s": 60.0,
            "weight_version": None, "is_paused": False,
        }
        await s.http.post("/pause?mode=keep", headers=ADMIN)
        assert (await s.http.get("/server_info", headers=ADMIN)).json()["is_paused"] is True


async def test_weight_routes_without_weight_transfer(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, settings=SETTINGS) as s:
        async def refused(path: str, **kw: Any) -> dict[str, Any]:
            return error_of(await s.http.post(path, headers=ADMIN, **kw), 400)

        # The engine's refusal names the flag that turns weight transfer on.
        for path, body in (("/init_weight_transfer_engine", {"init_info": {"a": 1}}),
                           ("/start_weight_update", None),
                           ("/start_weight_update", {"metadata": {"names": ["x"]}}),
                           ("/update_weights", {"update_info": {}}),
                           ("/finish_weight_update", None),
                           ("/finish_weight_update", {"weight_version": "v2"})):
            error = await refused(path, json=body)
            assert "--weight-transfer-config" in error["message"], (path, error)
            assert path[1:] in error["message"] and error["param"] is None, error

        for path, name in (("/init_weight_transfer_engine", "init_info"),
                           ("/update_weights", "update_info")):
            for kw in ({}, {"json": {}}, {"json": {name: None}}):
                error = await refused(path, **kw)
                assert error["message"] == f"Missing '{name}' in request body", error
                assert error["param"] == name
            assert (await refused(path, json={name: [1]}))["param"] == name
            error = await refused(path, json={name: {}, "foo": 1})
            assert error["param"] == "foo" and error["message"].startswith("foo: unknown field")
            error = await refused(path, json={name: {"n": 10**30}})
            assert error["param"] == name and "64-bit" in error["message"]
        assert (await refused("/finish_weight_update", json={"weight_version": 5}))["param"] == \
            "weight_version"
        assert (await refused("/start_weight_update", json={"metadata": "x"}))["param"] == \
            "metadata"
        assert (await refused("/start_weight_update", json={"names": []}))["param"] == "names"
        # vLLM's flag: true (its default) is taken and the call reaches the engine; false is
        # refused by name before it does.
        error = await refused("/start_weight_update", json={"is_checkpoint_format": True})
        assert "--weight-transfer-config" in error["message"], error
        error = await refused("/start_weight_update", json={"is_checkpoint_format": False})
        assert error["param"] == "is_checkpoint_format", error
        assert error["message"].startswith("is_checkpoint_format: got False, allowed: true")
        assert (await refused("/finish_weight_update?weight_version=v2"))["param"] == \
            "weight_version"
        assert (await s.http.get("/weight_info", headers=ADMIN)).json() == {"weight_version": None}


async def test_collective_rpc_refusals(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, settings=SETTINGS) as s:
        async def refused(body: Any) -> dict[str, Any]:
            return error_of(await s.http.post("/collective_rpc", headers=ADMIN, json=body), 400)

        error = await refused({"method": "load_model"})
        assert "not allowed" in error["message"] and "get_device_info" in error["message"]
        error = await refused({"method": "get_device_info", "kwargs": {"a": "1"}})
        assert error["param"] == "kwargs" and "kwargs are not supported" in error["message"]
        assert "takes no arguments" in (await refused({"method": "get_device_info",
                                                       "args": ["1"]}))["message"]
        assert (await refused({}))["message"] == "Missing 'method' in request body"
        for timeout in (0, -1, 1e9, "soon"):
            error = await refused({"method": "get_device_info", "timeout": timeout})
            assert error["param"] == "timeout", timeout
        assert (await refused({"method": "get_device_info", "tags": []}))["param"] == "tags"


CHOICE_KEYS = ["index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_logprobs"]


async def test_responses_carry_weight_versions(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, settings=SETTINGS) as s:
        body = {"prompt": "x", "max_tokens": 4, "n": 2}
        r = await s.http.post("/v1/completions", headers=USER, json=body)
        for choice in r.json()["choices"]:
            assert list(choice) == [*CHOICE_KEYS, "weight_versions"]  # OpenAI's order first
            assert choice["weight_versions"] == [{"version": None, "start": 0}]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = await s.http.post("/v1/chat/completions", headers=USER, json=chat)
        [choice] = r.json()["choices"]
        assert list(choice)[-1] == "weight_versions"
        assert choice["weight_versions"] == [{"version": None, "start": 0}]

        r = await s.http.post("/v1/completions", headers=USER,
                              json={**body, "stream": True, "echo": True})
        chunks = [e for e in sse_events(r.text)[:-1] if e["choices"]]
        for chunk in chunks:
            [choice] = chunk["choices"]
            assert list(choice) == [*CHOICE_KEYS, "weight_version"]
            assert choice["weight_version"] is None
        r = await s.http.post("/v1/chat/completions", headers=USER, json={**chat, "stream": True})
        chunks = [e for e in sse_events(r.text)[:-1] if e["choices"]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["choices"][0]["weight_version"] is None for c in chunks)

        # A request that never got a token (held while paused, then aborted): no spans.
        async with trio.open_nursery() as nursery:
            await s.http.post("/pause?mode=keep", headers=ADMIN)
            held = await _start(s, nursery, {"prompt": "x", "max_tokens": 4})
            await s.http.post("/pause", headers=ADMIN)
        [choice] = held[0].json()["choices"]
        assert choice["finish_reason"] == "abort" and choice["weight_versions"] == []


@pytest.mark.slow
async def test_weight_update_round_trip_over_http(demo_model_dir: Path) -> None:
    """A trainer (`WeightSyncClient` + `TrainerWeightTransferEngine`, shm) pushes the demo
    model's own weights as "v2" through a real HTTP server; completions then report "v2".
    collective_rpc reaches the real workers (the same checksum before and after: the same
    weights)."""
    import hypercorn.config
    import hypercorn.trio
    import torch
    from transformers import AutoModelForCausalLM

    from ringserve.weight_transfer import (
        ModuleWeightSource,
        TrainerWeightTransferEngine,
        WeightSyncClient,
    )

    settings = ServeSettings(served_model_name=MODEL, admin_api_key="sk-admin")
    async with serving(demo_model_dir, "default", settings=settings,
                       weight_transfer_config='{"backend": "shm"}') as s:
        config = hypercorn.config.Config()
        config.bind = ["127.0.0.1:0"]
        stop = trio.Event()

        def train(url: str) -> dict[str, Any]:
            client = WeightSyncClient(url, api_key="sk-admin", timeout=60)
            model = AutoModelForCausalLM.from_pretrained(str(demo_model_dir),
                                                         dtype=torch.float32)
            [before] = client.collective_rpc("get_weight_checksum")
            with TrainerWeightTransferEngine({"backend": "shm"}, client) as trainer:
                trainer.trainer_init(ModuleWeightSource(model))
                client.pause("keep")
                assert trainer.send_weights("v2") == "v2"
                client.resume()
            assert client.collective_rpc("get_weight_checksum", timeout=30) == [before]
            return client.server_info()

        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(hypercorn.trio.serve, s.app, config,
                                                shutdown_trigger=stop.wait))
            try:
                info = await trio.to_thread.run_sync(train, binds[0])
            finally:
                stop.set()
        assert info["weight_version"] == "v2"
        r = await s.http.post("/collective_rpc", headers=ADMIN,
                              json={"method": "get_device_info", "args": [], "kwargs": {},
                                    "timeout": 30})
        [device] = r.json()["results"]
        assert device["rank"] == 0 and device["world_size"] == 1 and device["device"] == "cpu"
        assert info["weight_transfer_config"]["backend"] == "shm"
        assert (await s.http.get("/weight_info", headers=ADMIN)).json() == {"weight_version": "v2"}
        r = await s.http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
        assert r.json()["choices"][0]["weight_versions"] == [{"version": "v2", "start": 0}]
        r = await s.http.post("/v1/completions",
                              json={"prompt": "Hello", "max_tokens": 3, "stream": True})
        chunks = [e for e in sse_events(r.text)[:-1] if e["choices"]]
        assert chunks and all(c["choices"][0]["weight_version"] == "v2" for c in chunks)
