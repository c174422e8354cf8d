"""The fault-tolerance routes over a real engine (mp executor, tiny model): a killed worker ends
the stream with an error event and [DONE], `/health` and new `/v1` requests get 503 while the
engine recovers, `POST /fault_tolerance/apply` (admin key) retries in the background and
`GET /fault_tolerance/status` follows it back to healthy; `abort` ends the engine."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
from http_app_harness import MODEL, Served, error_of, serving, sse_events

from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.engine.frontend.fault_tolerance import EngineFaultState, FaultStatusReport
from ringserve.http.settings import ServeSettings

SETTINGS = ServeSettings(served_model_name=MODEL, admin_api_key="sk-admin")
ADMIN = {"Authorization": "Bearer sk-admin"}
PROMPT = list(range(20, 33))


def _completion(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}


def worker_pids(llm: AsyncLLM) -> list[int]:
    """The worker processes of the engine's (only) core."""
    assert llm.client is not None
    core = llm.client.processes[0].pid
    kids: list[int] = []
    for task in Path(f"/proc/{core}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return [pid for pid in kids
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ringserve::Worker_TP")]


async def _status(s: Served) -> dict[str, Any]:
    r = await s.http.get("/fault_tolerance/status", headers=ADMIN)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def _wait_status(s: Served, status: str, timeout: float = 30.0) -> dict[str, Any]:
    with trio.fail_after(timeout):
        while True:
            engine: dict[str, Any] = (await _status(s))["engines"][0]
            if engine["status"] == status:
                return engine
            await trio.sleep(0.05)


async def _stream_killed(s: Served) -> list[Any]:
    """Stream a long completion and SIGKILL the worker while it runs; the SSE events."""
    (worker,) = worker_pids(s.engine)
    events: list[Any] = []

    async def stream() -> None:
        r = await s.http.post("/v1/completions", json=_completion(480, stream=True))
        assert r.status_code == 200
        events.extend(sse_events(r.text))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream)
        with trio.fail_after(10):
            while s.engine.output_processor.get_num_unfinished_requests() == 0:
                await trio.sleep(0.005)
        os.kill(worker, signal.SIGKILL)
    return events


@pytest.mark.slow
async def test_kill_worker_retry_over_http_then_abort(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, "default", settings=SETTINGS,
                       distributed_executor_backend="mp") as s:
        for method, path in (("GET", "/fault_tolerance/status"),
                             ("POST", "/fault_tolerance/apply")):
            assert error_of(await s.http.request(method, path), 401)
        assert await _status(s) == {"schema_version": 1, "total_engines": 1, "engines": [
            {"id": 0, "status": "healthy", "fault_info": None, "last_ft_request_id": None,
             "ft_error": None}]}
        assert (await s.http.get("/health")).status_code == 200
        r = await s.http.post("/v1/completions", json=_completion(8))
        before = r.json()["choices"][0]["text"]

        events = await _stream_killed(s)
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
        assert "engine fault" in events[-2]["error"]["message"]
        engine = await _wait_status(s, "unhealthy")
        assert "WorkerDied" in engine["fault_info"]
        assert error_of(await s.http.get("/health"), 503)["message"].startswith(
            "The engine is recovering")
        refused = error_of(await s.http.post("/v1/completions", json=_completion(8)), 503)
        assert "recovering" in refused["message"]

        for body in ({"instruction": "reboot"}, {"instruction": "retry", "params": {"x": 1}},
                     {"params": {}}):
            r = await s.http.post("/fault_tolerance/apply", json=body, headers=ADMIN)
            assert error_of(r, 400), body
        r = await s.http.post("/fault_tolerance/apply", json={"instruction": "retry",
                                                              "params": {}}, headers=ADMIN)
        assert r.status_code == 202, r.text
        request_id = r.json()["request_id"]
        engine = await _wait_status(s, "healthy")
        assert engine["last_ft_request_id"] == request_id
        assert (await s.http.get("/health")).status_code == 200
        r = await s.http.post("/v1/completions", json=_completion(8))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == before

        r = await s.http.post("/fault_tolerance/apply", json={"instruction": "abort"},
                              headers=ADMIN)
        assert r.status_code == 202, r.text
        await _wait_status(s, "dead")
        assert error_of(await s.http.get("/health"), 503)
        assert error_of(await s.http.post("/v1/completions", json=_completion(8)), 503)


def test_status_report_shape() -> None:
    report = FaultStatusReport.of([EngineFaultState(0), EngineFaultState(1, "unhealthy", "x")])
    assert msgspec.json.decode(msgspec.json.encode(report)) == {
        "schema_version": 1, "total_engines": 2, "engines": [
            {"id": 0, "status": "healthy", "fault_info": None, "last_ft_request_id": None,
             "ft_error": None},
            {"id": 1, "status": "unhealthy", "fault_info": "x", "last_ft_request_id": None,
             "ft_error": None}]}
