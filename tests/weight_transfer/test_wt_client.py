"""`WeightSyncClient` against a recording stdlib HTTP server: vLLM's paths and bodies, the
bearer token, and errors mapped to `WeightSyncError` with the server's message."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from ringserve.weight_transfer import WeightSyncClient, WeightSyncError


class Recorder:
    """What the fake server saw, and what it answers per path: (status, JSON body or raw
    text)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.answers: dict[str, tuple[int, Any]] = {}


def _handler(recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            recorder.requests.append({
                "method": self.command, "path": url.path, "query": parse_qs(url.query),
                "body": json.loads(raw) if raw else None,
                "auth": self.headers.get("Authorization"),
                "content_type": self.headers.get("Content-Type")})
            status, answer = recorder.answers.get(url.path, (200, {}))
            data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _serve

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    return Handler


@pytest.fixture
def server() -> Iterator[tuple[str, Recorder]]:
    recorder = Recorder()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(recorder))
    # A short poll: shutdown() waits for the loop's next look.
    thread = threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/", recorder
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def test_weight_sync_routes_and_bodies(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    client = WeightSyncClient(url, api_key="sekret")
    recorder.answers["/update_weights"] = (200, {"loaded": 3})
    assert client.init_weight_transfer_engine({"segments": ["s"]}) == {}
    assert client.start_weight_update({"names": ["w"], "dtype_names": ["float32"],
                                       "shapes": [[2]]}) == {}
    client.start_weight_update()
    assert client.update_weights({"segment": "s", "tensors": []}) == {"loaded": 3}
    client.finish_weight_update("7")
    client.finish_weight_update()
    seen = [(r["method"], r["path"], r["body"]) for r in recorder.requests]
    assert seen == [
        ("POST", "/init_weight_transfer_engine", {"init_info": {"segments": ["s"]}}),
        ("POST", "/start_weight_update",
         {"metadata": {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}}),
        ("POST", "/start_weight_update", None),
        ("POST", "/update_weights", {"update_info": {"segment": "s", "tensors": []}}),
        ("POST", "/finish_weight_update", {"weight_version": "7"}),
        ("POST", "/finish_weight_update", {"weight_version": None}),
    ]
    assert {r["auth"] for r in recorder.requests} == {"Bearer sekret"}
    assert recorder.requests[0]["content_type"] == "application/json"


def test_vllms_is_checkpoint_format(server: tuple[str, Recorder]) -> None:
    """True is what ringserve does (nothing more to send); False, and the flag in metadata's
    place, are refused before a request."""
    url, recorder = server
    client = WeightSyncClient(url)
    client.start_weight_update(is_checkpoint_format=True)
    with pytest.raises(ValueError, match=r"is_checkpoint_format=False .* is not supported"):
        client.start_weight_update(is_checkpoint_format=False)
    with pytest.raises(ValueError, match="is_checkpoint_format goes by keyword"):
        client.start_weight_update(True)  # type: ignore[arg-type]
    assert [(r["path"], r["body"]) for r in recorder.requests] == [
        ("/start_weight_update", None)]


def test_control_routes(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    client = WeightSyncClient(url)
    recorder.answers.update({
        "/is_paused": (200, {"is_paused": True}),
        "/get_world_size": (200, {"world_size": 4}),
        "/server_info": (200, {"version": "0.1.0", "weight_version": "3"}),
        "/collective_rpc": (200, {"results": ["a", "b"]}),
        "/health": (200, ""),
    })
    client.pause(mode="keep")
    client.pause()
    client.resume()
    assert client.is_paused() is True
    assert client.get_world_size() == 4
    assert client.get_world_size(include_dp=False) == 4
    assert client.server_info() == {"version": "0.1.0", "weight_version": "3"}
    assert client.collective_rpc("get_weight_checksum", timeout=5.0) == ["a", "b"]
    assert client.health() is True
    seen = [(r["method"], r["path"], r["query"]) for r in recorder.requests]
    assert seen == [
        ("POST", "/pause", {"mode": ["keep"]}),
        ("POST", "/pause", {"mode": ["abort"]}),
        ("POST", "/resume", {}),
        ("GET", "/is_paused", {}),
        ("GET", "/get_world_size", {"include_dp": ["true"]}),
        ("GET", "/get_world_size", {"include_dp": ["false"]}),
        ("GET", "/server_info", {}),
        ("POST", "/collective_rpc", {}),
        ("GET", "/health", {}),
    ]
    assert recorder.requests[7]["body"] == {"method": "get_weight_checksum", "args": [],
                                            "timeout": 5.0}
    assert all(r["auth"] is None for r in recorder.requests)


@pytest.mark.parametrize(("status", "body", "message"), [
    (400, {"error": {"message": "metadata does not match: 'w'", "type": "BadRequestError"}},
     "metadata does not match: 'w'"),
    (401, {"error": {"message": "Unauthorized"}}, "Unauthorized"),
    (500, {"detail": "boom"}, "boom"),
    (503, "not json", "not json"),
])
def test_errors_carry_the_server_message(server: tuple[str, Recorder], status: int, body: Any,
                                         message: str) -> None:
    url, recorder = server
    recorder.answers["/update_weights"] = (status, body)
    with pytest.raises(WeightSyncError) as info:
        WeightSyncClient(url).update_weights({})
    assert info.value.status == status
    assert info.value.message == message
    assert info.value.body == body
    assert str(info.value) == f"HTTP {status}: {message}"


def test_health_and_unreachable_server(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    recorder.answers["/health"] = (503, {"error": {"message": "engine dead"}})
    assert WeightSyncClient(url).health() is False
    dead = WeightSyncClient("http://127.0.0.1:9", timeout=2.0)  # discard port: refused
    assert dead.health() is False
    with pytest.raises(WeightSyncError) as info:
        dead.resume()
    assert info.value.status == 0


def test_malformed_answers_and_urls(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    recorder.answers["/get_world_size"] = (200, {"size": 2})
    recorder.answers["/collective_rpc"] = (200, {"results": 3})
    client = WeightSyncClient(url)
    with pytest.raises(WeightSyncError, match="'world_size'"):
        client.get_world_size()
    with pytest.raises(WeightSyncError, match="list of results"):
        client.collective_rpc("get_device_info")
    with pytest.raises(ValueError, match="http"):
        WeightSyncClient("127.0.0.1:8000")
