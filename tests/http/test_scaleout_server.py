"""`ringserve serve --api-server-count 2 -dp 2` as users run it (issue 19 items 1, 2 and 7).

Two API-server processes share the port, each connected to both engine cores: 200 concurrent
streams are each the greedy text of their own prompt; /metrics counts every request once
whichever frontend scrapes; /health and /fault_tolerance/status answer the same from every
frontend; a frontend killed with SIGKILL ends only its own streams and is restarted; SIGTERM
drains every frontend and exits 0; a SIGKILL of the supervisor leaves no process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from test_http_server import ADMIN_KEY, SMALL_FLAGS, LiveServer, _auth, _run_serve

from ringserve.shm.liveness import pid_alive

pytestmark = pytest.mark.slow

FLAGS = ("--data-parallel-size", "2", "--api-server-count", "2", "--admin-api-key", ADMIN_KEY,
         "--max-num-seqs", "64", "--shutdown-timeout", "30")
PROMPTS = [f"prompt number {i} says" for i in range(10)]


def _body(prompt: str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
            "temperature": 0.0, "ignore_eos": True}


def _processes(live: LiveServer) -> dict[str, list[int]]:
    """The supervisor's children by kind: frontend<i>, core, coordinator."""
    kinds: dict[str, list[int]] = {}
    for pid in live.children():
        try:  # the title each process gives itself (ringserve.lifeline)
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except FileNotFoundError:
            continue
        if title.startswith("ringserve::APIServer_"):
            kind = f"frontend{title.removeprefix('ringserve::APIServer_')}"
        elif title.startswith("ringserve::EngineCore_DP"):
            kind = "core"
        elif title == "ringserve::DPCoordinator":
            kind = "coordinator"
        else:
            kind = title
        kinds.setdefault(kind, []).append(pid)
    return kinds


async def _stream_text(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, int, str]:
    """(text, number of text events, finish reason or "error") of one streamed completion."""
    text, events, finish = [], 0, ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if "error" in payload:  # the stream ends with an error event
                return "".join(text), events, "error"
            choice = payload["choices"][0]
            if choice.get("text"):
                text.append(choice["text"])
                events += 1
            finish = choice.get("finish_reason") or finish
    return "".join(text), events, finish


async def _expected_texts(client: httpx.AsyncClient) -> dict[str, str]:
    """The greedy 8-token text of each prompt (non-streamed)."""
    expected = {}
    for prompt in PROMPTS:
        response = await client.post("/v1/completions", json=_body(prompt, 8, False))
        expected[prompt] = response.json()["choices"][0]["text"]
    return expected


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from ringserve.gpu.testing import tiny_model

    return tiny_model("llama")


@pytest.fixture(scope="module")
def shared(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One deployment for the streams test and then the killed-frontend test."""
    live = LiveServer(model_dir, tmp_path_factory.mktemp("scaleout") / "server.log", FLAGS)
    live.cmd.remove("--disable-log-stats")  # /metrics is checked
    with live:
        yield live


async def test_200_streams_over_two_frontends_and_two_engines(shared: LiveServer) -> None:
    live = shared
    kinds = _processes(live)
    assert len(kinds["frontend0"]) == len(kinds["frontend1"]) == 1
    assert len(kinds["core"]) == 2 and len(kinds["coordinator"]) == 1
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=live.url, timeout=120, limits=limits) as client:
        expected = await _expected_texts(client)
        results: list[tuple[str, str, int, str]] = []

        async def one(i: int) -> None:
            prompt = PROMPTS[i % len(PROMPTS)]
            text, events, finish = await _stream_text(client, _body(prompt, 8))
            results.append((prompt, text, events, finish))

        with trio.fail_after(240):
            async with trio.open_nursery() as nursery:
                for i in range(200):
                    nursery.start_soon(one, i)
        assert len(results) == 200
        for prompt, text, events, finish in results:
            assert (text, finish) == (expected[prompt], "length"), prompt
            assert 1 <= events <= 8
        # Every request is counted once, whichever frontend answers the scrape.
        total = 200 + len(PROMPTS)
        for _ in range(6):  # new connections land on either frontend
            async with httpx.AsyncClient(base_url=live.url, timeout=10) as fresh:
                scraped = (await fresh.get("/metrics")).text
                assert _metric(scraped, "ringserve:request_success_total") == total
                assert _metric(scraped, "ringserve:generation_tokens_total") == total * 8
                health = await fresh.get("/health")
                assert health.status_code == 200
                status = (await fresh.get("/fault_tolerance/status",
                                          headers=_auth(ADMIN_KEY))).json()
                assert status["total_engines"] == 2
                assert [e["status"] for e in status["engines"]] == ["healthy", "healthy"]
        per_engine = [_metric(scraped, f'ringserve:request_success_total{{engine="{e}"')
                      for e in "01"]
        assert min(per_engine) > 0, per_engine  # both engines served
    # Both frontends did work (CPU time), not one of them alone.
    for kind in ("frontend0", "frontend1"):
        fields = Path(f"/proc/{kinds[kind][0]}/stat").read_text().rsplit(")", 1)[1].split()
        assert int(fields[11]) + int(fields[12]) > 0


async def test_killed_frontend_is_restarted_and_the_others_streams_go_on(
        shared: LiveServer) -> None:
    live = shared
    victim = _processes(live)["frontend0"][0]
    outcomes: list[str] = []

    async def one(client: httpx.AsyncClient) -> None:
        try:
            _, events, finish = await _stream_text(client, _body("a long one", 120))
        except (httpx.HTTPError, AssertionError):
            outcomes.append("cut")
            return
        outcomes.append("done" if (finish, events >= 100) == ("length", True) else "bad")

    clients = [httpx.AsyncClient(base_url=live.url, timeout=120) for _ in range(16)]
    try:
        with trio.fail_after(240):
            async with trio.open_nursery() as nursery:
                for client in clients:
                    nursery.start_soon(one, client)
                await trio.sleep(3.0)
                os.kill(victim, signal.SIGKILL)
    finally:
        for client in clients:
            await client.aclose()
    assert "bad" not in outcomes, outcomes
    assert outcomes.count("done") >= 1, outcomes  # the other frontend's streams ran on
    with trio.fail_after(60):  # restarted: a new process for client index 0
        while True:
            fronts = _processes(live).get("frontend0", [])
            if fronts and fronts[0] != victim:
                break
            await trio.sleep(0.2)
    assert not pid_alive(victim)
    live.wait_ready()
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
        for _ in range(6):
            response = await client.post("/v1/completions", json=_body("after", 4, False))
            assert response.status_code == 200
    assert "API server 0 killed by signal SIGKILL: restarting it" in live.output()


async def test_sigterm_drains_every_frontend_then_exits_zero(model_dir: Path,
                                                             tmp_path: Path) -> None:
    with LiveServer(model_dir, tmp_path / "server.log", FLAGS) as live:
        children = live.children()
        finished: list[str] = []

        async def one() -> None:
            async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
                _, _, finish = await _stream_text(client, _body("drain me", 60))
                finished.append(finish)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(one)
                await trio.sleep(2.0)
                os.kill(live.pid, signal.SIGTERM)
        assert finished == ["length"] * 8
        assert live.wait(timeout=30) == 0, live.output()
        assert "Traceback" not in live.output()
        deadline = time.monotonic() + 10
        while any(pid_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if pid_alive(pid)]


def test_sigkill_of_the_supervisor_leaves_no_process(model_dir: Path, tmp_path: Path) -> None:
    with LiveServer(model_dir, tmp_path / "server.log", FLAGS) as live:
        children = live.children()
        assert len(children) == 5  # 2 frontends, 2 cores, the coordinator
        os.kill(live.pid, signal.SIGKILL)  # the supervisor only: not its group
        deadline = time.monotonic() + 10
        while any(pid_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in children if pid_alive(pid)]
        with contextlib.suppress(ProcessLookupError):
            for pid in left:
                os.kill(pid, signal.SIGKILL)
        assert not left


def test_a_core_that_cannot_start_stops_the_deployment_with_its_reason(model_dir: Path) -> None:
    """Not restarted, not a crash loop: one line with the core's reason, exit 2, no child."""
    done = _run_serve(str(model_dir), "--port", "0", *SMALL_FLAGS, *FLAGS,
                      "--kv-cache-memory", "1KiB")
    assert done.returncode == 2, done.stderr
    assert "failed to start: ValueError: the KV cache gets 1024 bytes" in done.stderr
    assert "restarting it" not in done.stderr and "Traceback" not in done.stderr
