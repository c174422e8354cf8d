"""A client that leaves: the app stops generating, the request is aborted in the core and its
KV blocks come back, for a stream and for a plain response (the ASGI app driven directly, as
a server would; the real tiny model, slow enough that the request is surely still running
when the client leaves)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
from http_app_harness import Served, drained, serving


async def _leave_early(s: Served, body: dict[str, Any], chunks_before_leaving: int,
                       ) -> list[bytes]:
    """Post `body` to /v1/completions and disconnect after that many body chunks (0: once
    the engine holds KV blocks for it); returns the chunks received."""
    raw = json.dumps(body).encode()
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.1"},
        "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
        "root_path": "", "server": ("test", 80), "client": ("client", 1),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(raw)).encode())]}
    gone = trio.Event()
    chunks: list[bytes] = []
    body_sent = False

    async def kv_usage() -> float:
        return float((await s.engine.call_utility("get_stats"))[0]["kv_cache_usage"])

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        if chunks_before_leaving == 0:
            while await kv_usage() == 0.0:
                await trio.sleep(0.01)
            gone.set()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            if len(chunks) == chunks_before_leaving:
                assert await kv_usage() > 0.0  # still generating, holding blocks
                gone.set()

    with trio.fail_after(10):
        await s.app(scope, receive, send)
    assert gone.is_set()
    return chunks


@pytest.mark.slow
async def test_disconnect_aborts_and_frees_blocks(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, "default") as s:
        long = {"prompt": [5] * 8, "max_tokens": 500, "ignore_eos": True}
        chunks = await _leave_early(s, {**long, "stream": True}, 3)
        assert not any(b"[DONE]" in c or b'"length"' in c for c in chunks)
        assert s.state.in_flight == 0
        assert s.engine.output_processor.get_num_unfinished_requests() == 0
        assert (await drained(s.engine))["kv_cache_usage"] == 0.0

        with trio.fail_after(3):  # far less than 500 tokens take
            await _leave_early(s, long, 0)
        assert s.state.in_flight == 0
        assert s.engine.output_processor.get_num_unfinished_requests() == 0
        assert (await drained(s.engine))["kv_cache_usage"] == 0.0
