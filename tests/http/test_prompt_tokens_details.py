"""`--enable-prompt-tokens-details` (issue 48.6): chat and completions usage carries
`prompt_tokens_details.cached_tokens`, the request's prefix-cache hit, in plain responses and
in the final usage chunk of a stream; without the flag usage keeps its three fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from http_app_harness import MODEL, serving, sse_events

from ringserve.cli import parse_command_line
from ringserve.http.settings import ServeSettings

pytestmark = pytest.mark.slow

DETAILS = ServeSettings(served_model_name=MODEL, enable_prompt_tokens_details=True)
# Long enough to fill several KV blocks, so a repeat reads whole blocks from the cache.
PROMPT = " ".join(f"word{i}" for i in range(80))
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}


async def _post(s: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await s.http.post(path, json={"model": MODEL, **GREEDY, **body})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def test_cached_tokens_in_usage(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, "default", settings=DETAILS) as s:
        chat = {"messages": [{"role": "user", "content": PROMPT}]}
        first = (await _post(s, "/v1/chat/completions", chat))["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        again = (await _post(s, "/v1/chat/completions", chat))["usage"]
        cached = again["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < again["prompt_tokens"]

        stream = await s.http.post("/v1/chat/completions", json={
            "model": MODEL, **GREEDY, **chat, "stream": True,
            "stream_options": {"include_usage": True}})
        events = [e for e in sse_events(stream.text) if e != "[DONE]"]
        assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}

        completion = {"prompt": PROMPT}
        await _post(s, "/v1/completions", completion)
        hit = (await _post(s, "/v1/completions", completion))["usage"]
        assert hit["prompt_tokens_details"]["cached_tokens"] > 0
        two = (await _post(s, "/v1/completions", {"prompt": [PROMPT, PROMPT]}))["usage"]
        assert two["prompt_tokens_details"]["cached_tokens"] == 2 * hit[
            "prompt_tokens_details"]["cached_tokens"]


async def test_usage_without_the_flag_has_three_fields(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, "default") as s:
        for _ in range(2):
            body = await _post(s, "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": PROMPT}]})
            assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_the_flag_parses() -> None:
    ns = parse_command_line(["serve", "m", "--enable-prompt-tokens-details"])
    assert ns.enable_prompt_tokens_details is True
    assert parse_command_line(["serve", "m"]).enable_prompt_tokens_details is False
