"""`ringserve serve` as users run it: a live subprocess on a free port with the tiny model.

Covers the process lifecycle (readiness, SIGTERM drain with 503s, exit status, engine death
ending streams with an error event and the process with status 1), start-up mistakes (port in
use, missing model directory, bad values: one stderr line, no traceback), the official openai
client (completions and chat, streaming and not, n=2, usage, logprobs, error types), HTTP/2
with prior knowledge (50 concurrent streams on one h2c connection), h2 by ALPN over TLS, a
client disconnect aborting its request, and spot checks of the API and admin keys. One shared
server serves most checks; the drain, engine-death and TLS checks each own one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import pytest
import trio

pytestmark = pytest.mark.slow

API_KEY = "sk-test-key"
ADMIN_KEY = "admin-test-key"
SMALL_FLAGS = ("--device", "cpu", "--kv-cache-memory", "16MiB", "--max-model-len", "512",
               "--disable-log-stats")
READY_TIMEOUT_S = 60.0
SERVE = (sys.executable, "-m", "ringserve.cli", "serve")


# -- harness ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _run_serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=60)


class LiveServer:
    """A `ringserve serve` subprocess on a free port; killed (with its group) on exit."""

    def __init__(self, model: Path, log: Path, extra: Sequence[str] = (), *,
                 tls: bool = False) -> None:
        self.port = _free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.log = log
        self.cmd = [*SERVE, str(model), "--port", str(self.port), "--served-model-name", "tiny",
                    *SMALL_FLAGS, *extra]
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LiveServer:
        with self.log.open("wb") as out:
            # Its own session, so that the final killpg also takes the engine cores.
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            self.wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.kill()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"exited with {self.proc.returncode}:\n{self.output()}")
            with contextlib.suppress(httpx.HTTPError):
                health = httpx.get(f"{self.url}/health", timeout=1.0, verify=False)
                if health.status_code == 200:
                    return
            time.sleep(0.1)
        raise AssertionError(f"not ready in {timeout} s:\n{self.output()}")

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def children(self) -> list[int]:
        """The server's child processes (its engine cores)."""
        # Every thread's list: the cores are started from a worker thread.
        tasks = Path(f"/proc/{self.pid}/task").glob("*/children")
        return sorted(int(pid) for path in tasks for pid in path.read_text().split())

    def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def _auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _completion_body(max_tokens: int, prompt: str = "hello world") -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}


async def _stream_events(client: httpx.AsyncClient, body: dict[str, Any],
                         ) -> AsyncIterator[str]:
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                yield line[len("data: "):]


async def _core_is_idle(client: httpx.AsyncClient) -> bool:
    """True when no request is left in the engine core (only then does it agree to sleep)."""
    admin = _auth(ADMIN_KEY)
    resp = await client.post("/sleep", headers=admin)
    if resp.status_code == 200:
        assert (await client.post("/wake_up", headers=admin)).status_code == 200
        return True
    assert resp.status_code == 400 and "in flight" in resp.text, resp.text
    return False


async def _wait_core_idle(client: httpx.AsyncClient, timeout: float) -> None:
    with trio.fail_after(timeout):
        while not await _core_is_idle(client):
            await trio.sleep(0.05)


async def _kv_cache_usage(client: httpx.AsyncClient) -> float | None:
    """`ringserve:kv_cache_usage_perc` from /metrics (None while the app does not export it)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ringserve:kv_cache_usage_perc":
                return float(sample.value)
    return None


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[LiveServer]:
    """One server for the checks that leave it running."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with LiveServer(tiny_llama_dir, log,
                    ("--api-key", API_KEY, "--admin-api-key", ADMIN_KEY)) as live:
        yield live


# -- start-up mistakes -----------------------------------------------------------------------


def _one_error_line(proc: subprocess.CompletedProcess[str], status: int = 2) -> str:
    assert proc.returncode == status, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ringserve: error: ")
    return lines[0]


def test_port_in_use_is_one_line(tiny_llama_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _run_serve(str(tiny_llama_dir), "--port", str(port), *SMALL_FLAGS)
    line = _one_error_line(proc)
    assert f"127.0.0.1:{port}" in line and "address already in use" in line


def test_missing_model_dir_is_one_line(tmp_path: Path) -> None:
    line = _one_error_line(_run_serve(str(tmp_path / "nope"), *SMALL_FLAGS), status=1)
    assert str(tmp_path / "nope") in line and "does not exist" in line


@pytest.mark.slow
def test_tensor_of_the_wrong_shape_is_one_line_and_exit_one(tiny_llama_dir: Path,
                                                             tmp_path: Path) -> None:
    """Found only in the worker, while loading: one line, exit 1, nothing left running. (The
    engine core's teardown used to print the frontend's SIGTERM as "Exception ignored ...
    _Shutdown" under the line in about half of the runs by hand; the race is too rare under
    pytest for this test to catch it reliably.)"""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    weights = load_file(str(model / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name][:, :3].contiguous()
    save_file(weights, str(model / "model.safetensors"))
    proc = _run_serve(str(model), "--port", "0", *SMALL_FLAGS)
    assert proc.returncode == 1, proc.stderr
    # The server's own start-up log lines (hypercorn listens before the engine is up) are
    # INFO records; everything else is the one error line.
    lines = [ln for ln in proc.stderr.strip().splitlines() if " INFO " not in ln]
    assert len(lines) == 1 and lines[0].startswith("ringserve: error: "), proc.stderr
    assert f"{model / 'model.safetensors'}: tensor '{name}': shape [64, 3]" in lines[0]


@pytest.mark.parametrize(("flags", "expected"), [
    (("--port", "70000"), "--port: got 70000, allowed: 0..65535"),
    (("--shutdown-timeout", "-1"), "--shutdown-timeout: got -1.0"),
    (("--timeout-keep-alive", "0"), "--timeout-keep-alive: got 0.0, allowed: seconds > 0"),
    (("--port", "x"), "argument --port: invalid int value: 'x'"),
    (("--certfile", "/nonexistent.pem"), "--certfile needs --keyfile"),
    (("--chat-template", "no_such_template.jinja"), "--chat-template: 'no_such_template.jinja'"),
    (("--max-num-queued-reqs", "0"), "max_num_queued_reqs: got 0"),
])
def test_bad_values_are_one_line(tiny_llama_dir: Path, flags: tuple[str, ...], expected: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    from ringserve.cli import main

    try:
        status = main(["serve", str(tiny_llama_dir), *SMALL_FLAGS, *flags])
    except SystemExit as exc:  # argparse's own errors
        status = int(exc.code or 0)
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("ringserve: error: "), err
    assert expected in err


# -- the shared server -----------------------------------------------------------------------


async def test_health_open_and_v1_needs_the_key(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/v1/models")).status_code == 401
        wrong = await client.get("/v1/models", headers=_auth("wrong"))
        assert wrong.status_code == 401
        ok = await client.get("/v1/models", headers=_auth())
        assert ok.status_code == 200
        assert [m["id"] for m in ok.json()["data"]] == ["tiny"]
        body = _completion_body(4)
        assert (await client.post("/v1/completions", json=body)).status_code == 401
        # Admin routes take the admin key, not the API key.
        refused = await client.post("/reset_prefix_cache", headers=_auth(API_KEY))
        assert refused.status_code in (401, 403)
        done = await client.post("/reset_prefix_cache", headers=_auth(ADMIN_KEY))
        assert done.status_code == 200


async def test_50_concurrent_streams_over_one_h2c_connection(server: LiveServer) -> None:
    results: dict[int, list[str]] = {}
    versions: set[str] = set()
    async with httpx.AsyncClient(base_url=server.url, http1=False, http2=True,
                                 headers=_auth(), timeout=60,
                                 limits=httpx.Limits(max_connections=1)) as client:

        async def one(index: int) -> None:
            body = _completion_body(8, prompt=f"request {index}")
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                versions.add(resp.http_version)
                assert resp.status_code == 200
                results[index] = [line async for line in resp.aiter_lines()
                                  if line.startswith("data: ")]

        async with trio.open_nursery() as nursery:
            for index in range(50):
                nursery.start_soon(one, index)
    assert versions == {"HTTP/2"}
    assert len(results) == 50
    for events in results.values():
        assert events[-1] == "data: [DONE]"
        assert len(events) >= 2


async def test_disconnect_mid_stream_aborts_and_returns_blocks(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url, headers=_auth(), timeout=30) as client:
        # A client slowed by a loaded machine can read its third event after the tiny model
        # has produced all 480 tokens: such an attempt tests nothing, and is made again.
        in_flight = False
        for _ in range(5):
            await _wait_core_idle(client, 10.0)
            events = 0
            async with client.stream("POST", "/v1/completions",
                                     json=_completion_body(480)) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    events += line.startswith("data: ")
                    if events == 3:
                        in_flight = not await _core_is_idle(client)
                        if in_flight:  # the request runs in the core: leave mid-body
                            break
            if in_flight:
                break
        assert in_flight, "the request never ran in the core when its third event arrived"
        # Leaving `stream` mid-body closes the connection: the server must abort the request.
        await _wait_core_idle(client, 5.0)
        usage = await _kv_cache_usage(client)
        assert usage in (None, 0.0)


def test_openai_client_completions(server: LiveServer) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    two = client.completions.create(model="tiny", prompt="hello world", max_tokens=6, n=2,
                                    temperature=1.0, seed=1, logprobs=2,
                                    extra_body={"ignore_eos": True})
    assert sorted(choice.index for choice in two.choices) == [0, 1]
    assert two.usage is not None and two.usage.completion_tokens == 12
    assert two.usage.total_tokens == two.usage.prompt_tokens + 12
    logprobs = two.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == 6
    chunks = list(client.completions.create(model="tiny", prompt="hello world", max_tokens=5,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    bad_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


def test_openai_client_chat(server: LiveServer) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    messages: Any = [{"role": "user", "content": "Say hi"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, n=2,
                                           max_completion_tokens=5, seed=3,
                                           extra_body={"ignore_eos": True})
    assert len(reply.choices) == 2
    assert all(choice.message.role == "assistant" for choice in reply.choices)
    assert reply.usage is not None and reply.usage.completion_tokens == 10
    stream = client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=4,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    first_delta: dict[int, Any] = {}
    finished: set[int] = set()
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            first_delta.setdefault(choice.index, choice.delta)
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert {i: d.role for i, d in first_delta.items()} == {0: "assistant", 1: "assistant"}
    assert finished == {0, 1}
    assert usage is not None and usage.completion_tokens == 8


# -- servers of their own --------------------------------------------------------------------


@pytest.mark.parametrize("ctrl_c_to_group", [False, True], ids=["sigterm", "sigint-to-group"])
async def test_sigterm_drains_then_exits_zero(tiny_llama_dir: Path, tmp_path: Path,
                                              ctrl_c_to_group: bool) -> None:
    """SIGTERM to the server, or a terminal's Ctrl-C (SIGINT to the whole process group, the
    engine core included), drains in-flight streams and exits 0."""
    admin = _auth(ADMIN_KEY)
    # The drain's limit is generous: a loaded machine (the suite's other worker) can make the
    # paused stream plus its 400 tokens take tens of seconds, and the limit is not under test.
    with LiveServer(tiny_llama_dir, tmp_path / "server.log",
                    ("--shutdown-timeout", "120", "--admin-api-key", ADMIN_KEY)) as live:
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as client:
            events: list[str] = []
            async for event in _stream_events(client, _completion_body(400)):
                events.append(event)
                if len(events) != 2:
                    continue
                # Hold the stream in flight (the engine stops scheduling) while we look.
                assert (await client.post("/pause?mode=keep", headers=admin)).status_code == 200
                if ctrl_c_to_group:
                    os.killpg(live.pid, signal.SIGINT)  # the server leads its own session
                else:
                    os.kill(live.pid, signal.SIGTERM)
                # A second connection: new work and /health are refused while draining.
                async with httpx.AsyncClient(base_url=live.url, timeout=5) as other:
                    with trio.fail_after(5):
                        while (await other.get("/health")).status_code != 503:
                            await trio.sleep(0.02)
                    late = await other.post("/v1/completions", json=_completion_body(4))
                    assert late.status_code == 503
                    assert late.json()["error"]["code"] == 503
                    await trio.sleep(0.5)
                    assert live.proc is not None and live.proc.poll() is None  # waits for us
                    assert (await other.post("/resume", headers=admin)).status_code == 200
            stream_end = time.monotonic()
        # The stream ran to its end (finish reason "length"), then the server stopped.
        assert events[-1] == "[DONE]", (events[-3:], live.output())
        final = json.loads(events[-2])  # an error event says why the stream did not finish
        assert "choices" in final and final["choices"][0]["finish_reason"] == "length", (
            final, live.output())
        assert live.wait(timeout=15) == 0, live.output()
        assert time.monotonic() - stream_end < 10
        assert "Traceback" not in live.output()
        assert "stopped" in live.output()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_tls_negotiates_h2_by_alpn(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    with LiveServer(tiny_llama_dir, tmp_path / "server.log",
                    ("--certfile", str(cert), "--keyfile", str(key)), tls=True) as live:
        for http2, expected in ((True, "HTTP/2"), (False, "HTTP/1.1")):
            trust = ssl.create_default_context(cafile=str(cert))
            async with httpx.AsyncClient(base_url=live.url, verify=trust, http2=http2) as client:
                resp = await client.post("/v1/completions", json={**_completion_body(3),
                                                                  "stream": False})
                assert resp.status_code == 200, resp.text
                assert resp.http_version == expected
                assert resp.json()["usage"]["completion_tokens"] == 3


async def test_engine_death_ends_streams_then_exits_one(tiny_llama_dir: Path,
                                                       tmp_path: Path) -> None:
    # Without fault tolerance (with it, the core is restarted: test_http_server_deaths.py).
    with LiveServer(tiny_llama_dir, tmp_path / "server.log",
                    ("--no-enable-fault-tolerance",)) as live:
        (core,) = live.children()
        events: list[str] = []
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as client:
            async for event in _stream_events(client, _completion_body(400)):
                events.append(event)
                if len(events) == 2:
                    os.kill(core, signal.SIGKILL)
        # The stream still ends the OpenAI way: an error event, then [DONE].
        assert events[-1] == "[DONE]"
        assert "error" in json.loads(events[-2]), events[-2]
        assert live.wait(timeout=20) == 1, live.output()
        errors = [line for line in live.output().splitlines()
                  if line.startswith("ringserve: error: ")]
        assert errors == ["ringserve: error: the engine died: engine core 0 killed by "
                          "signal SIGKILL"], live.output()
        assert "Traceback" not in live.output()
