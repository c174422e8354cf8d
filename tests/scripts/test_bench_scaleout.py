"""scripts/bench_scaleout.py: its SSE parsing and per-stream checks, the epoll client against a
fake streaming server (keep-alive, a connection cut mid-stream), the report's medians, ranges,
per-round ratios and failure marks, and (slow) one tiny real run of 1 and 2 API servers."""

from __future__ import annotations

import importlib.util
import itertools
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_scaleout", SCRIPTS / "bench_scaleout.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"  # as h11 frames one ASGI body message


def _event(body: Any) -> bytes:
    return _chunk(b"data: " + json.dumps(body).encode() + b"\n\n")


def sse_response(texts: list[str], tokens: int | None, finish: str = "length",
                 done: bool = True, error: bool = False) -> list[bytes]:
    """A ringserve-like streamed completion, one element per HTTP chunk."""
    parts = [b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\n"
             b"transfer-encoding: chunked\r\n\r\n"]
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        parts.append(_event({"choices": [{"index": 0, "text": text,
                                          "finish_reason": finish if last else None}],
                             "usage": None}))
    if error:
        parts.append(_event({"error": {"message": "boom", "code": 500}}))
    if tokens is not None:
        parts.append(_event({"choices": [], "usage": {"completion_tokens": tokens}}))
    if done:
        parts.append(_chunk(b"data: [DONE]\n\n"))
        parts.append(b"0\r\n\r\n")
    return parts


def stream_of(parts: list[bytes], **kw: Any) -> Any:
    """A received Stream: part i arrived at time 1 + i (the headers with the first event)."""
    stream = bench.Stream(sent=0.5, **kw)
    for i, part in enumerate(parts):
        stream.raw += part
        if i:
            stream.recvs.append((float(i), len(stream.raw)))
    return stream


def test_a_full_stream_passes_with_its_token_events_and_gaps() -> None:
    res = bench.analyze(stream_of(sse_response(["a", "bc", "d"], tokens=4)), 4)
    assert res.error == ""
    assert res.tokens == 4 and res.events == 3  # two tokens merged into one chunk
    assert res.ttft == pytest.approx(0.5) and res.itl == pytest.approx([1.0, 1.0])


def test_one_recv_can_hold_several_chunks_and_split_one() -> None:
    raw = b"".join(sse_response(["a", "b"], tokens=2))
    first_event_end = raw.index(b"\n\n\r\n") + 4
    stream = bench.Stream(sent=0.0, raw=bytearray(raw),
                          recvs=[(1.0, first_event_end - 5), (2.0, first_event_end),
                                 (3.0, len(raw))])
    status, events = bench.sse_events(bytes(stream.raw), stream.recvs)
    assert status == 200 and [t for t, _ in events] == [2.0, 3.0, 3.0, 3.0]
    assert bench.analyze(stream, 2).error == ""


@pytest.mark.parametrize(("parts", "kw", "error"), [
    (sse_response(["a", "b"], tokens=2), {}, "2 tokens, not 3"),
    (sse_response(["a", "b", "c"], tokens=3, finish="stop"), {}, "finish_reason 'stop'"),
    (sse_response(["a", "b", "c"], tokens=3, done=False), {}, "no [DONE]"),
    (sse_response(["a", "b", "c"], tokens=3, done=False), {"closed": True},
     "connection closed mid-stream"),
    (sse_response(["a"], tokens=None, done=False), {"hung": True}, "hung"),
    (sse_response(["a", "b", "c"], tokens=3, error=True), {}, "error chunk"),
    ([b"HTTP/1.1 400 \r\ncontent-length: 19\r\n\r\n", b'{"error": "ignore"}'], {},
     "HTTP 400: {\"error\": \"ignore\"}"),
    ([b""], {"closed": True}, "no HTTP response"),
])
def test_every_broken_stream_is_reported(parts: list[bytes], kw: dict[str, Any],
                                         error: str) -> None:
    assert error in bench.analyze(stream_of(parts, **kw), 3).error


def test_a_non_stream_response_ends_at_its_content_length() -> None:
    head = b"HTTP/1.1 400 \r\ncontent-length: 4\r\n\r\n"
    assert not bench._ended_other(bytearray(head + b"ab"))
    assert bench._ended_other(bytearray(head + b"abcd"))
    assert not bench._ended_other(bytearray(b"HTTP/1.1 200 \r\ncontent-length: 4\r\n\r\nabcd"))


def test_roles_come_from_the_titles() -> None:
    assert bench.role_of("python -m ringserve.cli serve", True, 1) == "frontend"
    assert bench.role_of("python -m ringserve.cli serve", True, 2) == "supervisor"
    assert bench.role_of("ringserve::APIServer_1", False, 2) == "frontend"
    assert bench.role_of("ringserve::EngineCore_DP0", False, 2) == "engine core"
    assert bench.role_of("ringserve::DPCoordinator", False, 2) == "coordinator"
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and bench.percentile([], 99) == 0.0


def test_arguments_are_checked() -> None:
    ns = bench.parse_args([])
    assert ns.api_server_counts == [1, 2] and ns.concurrency == 1024
    assert ns.num_requests == 4096 and ns.output_len == 16 and ns.runs == 3
    for bad in (["--api-servers", "1,x"], ["--api-servers", "0,2"], ["--runs", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def _fake_server(answer: Any) -> Iterator[int]:
    """A streaming server on keep-alive connections; `answer(n, k)` for the n-th request
    overall, the k-th on its connection: the number of parts of `sse_response` to send (-1:
    all), and whether to close the connection afterwards."""
    listener = socket.create_server(("127.0.0.1", 0))
    served = [0]
    lock = threading.Lock()

    def handle(conn: socket.socket) -> None:
        with conn:
            buf = b""
            for k in itertools.count(1):
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(buf) < length:
                    buf += conn.recv(65536)
                body, buf = json.loads(buf[:length]), buf[length:]
                with lock:
                    served[0] += 1
                    n = served[0]
                parts = sse_response(["t"] * body["max_tokens"], tokens=body["max_tokens"])
                count, close = answer(n, k)
                for part in parts[:count] if count >= 0 else parts:
                    conn.sendall(part)
                if close:
                    return

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


@pytest.fixture
def cutting_server() -> Iterator[int]:
    """Cuts the 3rd request after its first event."""
    yield from _fake_server(lambda n, k: (2, True) if n == 3 else (-1, False))


@pytest.fixture
def stale_server() -> Iterator[int]:
    """Closes each connection without an answer when its second request arrives (an idle
    keep-alive connection the server timed out just as the client reused it)."""
    yield from _fake_server(lambda n, k: (0, True) if k == 2 else (-1, False))


def _drive(port: int, total: int) -> tuple[Any, list[Any]]:
    body = json.dumps({"max_tokens": 3, "stream": True}).encode()
    client = bench.Client(port, 4, body)
    try:
        streams = client.drive(total, timeout_s=10.0)
        assert len(client.socks) <= 4 and sorted(client.idle) == sorted(client.socks)
    finally:
        client.close()
    return client, [bench.analyze(s, 3) for s in streams]


def test_the_client_keeps_concurrency_and_reports_a_cut_stream(cutting_server: int) -> None:
    client, results = _drive(cutting_server, 10)
    assert len(results) == 10 and client.retries == 0
    assert [r.error for r in results if r.error] == ["connection closed mid-stream"]
    assert sum(r.tokens for r in results) == 9 * 3 + 1  # the cut one: its one token event


def test_a_request_on_a_timed_out_keep_alive_connection_is_sent_again(stale_server: int) -> None:
    client, results = _drive(stale_server, 10)
    assert len(results) == 10 and not [r.error for r in results if r.error]
    assert client.retries == 6  # every request after the first 4 met a closed connection


def _run(api_servers: int, round_no: int, tok_s: float, failures: int = 0) -> dict[str, Any]:
    r: dict[str, Any] = {k: 1.0 for _, k, _ in bench.COLUMNS}
    r.update(api_servers=api_servers, round=round_no, tok_s=tok_s, failures=failures,
             processes_gone=[], frontend_us_per_token=74.0 if api_servers == 1 else 80.0,
             frontend_cpu_pct=95.0 if api_servers == 1 else 170.0, other_cpu_pct=1.0)
    return r


def test_report_medians_ranges_per_round_ratios_and_failures() -> None:
    results = [_run(1, 1, 1000), _run(2, 1, 1500), _run(1, 2, 800), _run(2, 2, 1600, failures=2),
               _run(1, 3, 1200), _run(2, 3, 1500)]
    table = bench.table(results, [1, 2])
    assert "| 1 | 3 | 1,000 [800-1,200] |" in table
    assert "| 2 | 3 | 1,500 [1,500-1,600] |" in table and table.endswith("| 2 !!! |")
    results[4]["other_cpu_pct"] = 90.0  # round 3's 1-server run shared the machine
    ratio, quiet = bench.ratios(results, [1, 2])
    # Per round 1.50, 2.00, 1.25: the median of the ratios, not the ratio of the medians.
    assert "1.50x (per round: 1.50 (other processes 1% / 1%), 2.00 (" in ratio
    assert "1.25 (other processes 90% / 1%); range 1.25-2.00)" in ratio
    assert "target >= 1.4x on the median: met" in ratio
    assert "2 of 3, ratio 1.75 [1.50-2.00]" in quiet
    low = [_run(1, 1, 1000), _run(2, 1, 1100)]
    assert "NOT met" in bench.ratios(low, [1, 2])[0]
    cost = bench.frontend_cost(results, [1, 2])
    assert "frontend-bound" in cost[0] and "NOT" not in cost[0]
    assert "74.0 [74.0-74.0] µs" in cost[1] and "2.00x the ~37 µs" in cost[1]


@pytest.mark.slow
def test_a_tiny_real_run_streams_every_token_and_leaves_no_process(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, str(SCRIPTS / "bench_scaleout.py"), "--runs", "1",
                          "--concurrency", "8", "--num-requests", "24", "--output-len", "4",
                          "--log-dir", str(tmp_path), "--json", str(out)],
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert '"command":' in run.stdout and "| API servers |" in run.stdout
    results = json.loads(out.read_text())["runs"]
    assert [r["api_servers"] for r in results] == [1, 2]
    for r in results:
        assert r["failures"] == 0 and r["tokens"] == 24 * 4
        roles = sorted(p["role"] for p in r["processes"])
        assert roles.count("frontend") == r["api_servers"] and "engine core" in roles
        for p in r["processes"]:
            assert not _running(p["pid"], p["title"]), p


def _running(pid: int, title: str) -> bool:
    """`pid` still runs the process of that title (not a zombie, not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and cmdline.strip()[:80] == title
