"""`POST /v1/messages` and `/v1/messages/count_tokens` (Anthropic's Messages API) through the
official `anthropic` client: on the tiny Llama (plain text, streamed == plain, the same answer
and usage as the chat route, the prefix cache in usage, forced tool calls valid for their
schema, a tool round trip, a disconnect aborting), and on the null model with a scripted
`generate` (parsed tool calls and thinking blocks, the prompt equal to the chat route's,
Claude Code's attribution line, stop reasons, pings, every bad input as Anthropic's error),
then once against a live `ringserve serve` with `--api-key` sent as `x-api-key`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import jsonschema
import pytest
import trio
from http_app_harness import BASE_URL, MODEL, Served, drained, serving
from structured_harness import pieces_of, script

from ringserve.http.agents import messages_stream
from ringserve.http.agents.messages_translate import strip_billing_line
from ringserve.http.settings import ServeSettings
from ringserve.http.tool_parsers.request import AUTO_NEEDS_FLAGS
from ringserve.outputs import CompletionOutput, RequestOutput
from ringserve.sampling_params import SamplingParams

GREEDY: Any = {"temperature": 0.0}
USER: Any = [{"role": "user", "content": "Weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo"]},
    "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}
WEATHER: Any = {"name": "get_weather", "description": "Current weather", "input_schema": SCHEMA}
TIME: Any = {"name": "get_time", "input_schema": {"type": "object", "properties": {},
                                                  "additionalProperties": False}}
AUTO = ServeSettings(served_model_name=MODEL, enable_auto_tool_choice=True,
                     tool_call_parser="hermes")
HERMES_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n'
                '{"name": "get_time", "arguments": {}}\n</tool_call>')
BILLING = "x-anthropic-billing-header: cc_version=1.0.0; cc_entrypoint=cli; cch=abc123;"
# Long enough to fill several KV blocks, so a repeat reads whole blocks from the cache.
LONG_SYSTEM = " ".join(f"word{i}" for i in range(80))

pytestmark = pytest.mark.slow  # each test starts an engine (a second or more)


@asynccontextmanager
async def claude(s: Served, api_key: str = "unused") -> AsyncIterator[anthropic.AsyncAnthropic]:
    """The official client, talking to the app in-process (it brings its own httpx2)."""
    transport = httpx2.ASGITransport(app=s.app)
    async with httpx2.AsyncClient(transport=transport, base_url=BASE_URL, timeout=30) as http:
        yield anthropic.AsyncAnthropic(base_url=BASE_URL, api_key=api_key, http_client=http,
                                       max_retries=0)


def as_dict(message: Any) -> dict[str, Any]:
    """A message as JSON, ids (the message's, the calls') and the client's extras left out,
    the usage's prompt tokens summed (a repeat reads some from the prefix cache)."""
    out: dict[str, Any] = message.model_dump(mode="json", exclude={"id"})
    usage = out["usage"]
    usage["input_tokens"] += usage.pop("cache_read_input_tokens") or 0
    for block in out["content"]:
        block.pop("id", None)
        block.pop("parsed_output", None)
    return out


async def plain_and_streamed(client: anthropic.AsyncAnthropic,
                             **body: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same request plain and streamed, each as the client parses it."""
    plain = await client.messages.create(model=MODEL, **body)
    async with client.messages.stream(model=MODEL, **body) as stream:
        streamed = await stream.get_final_message()
    return as_dict(plain), as_dict(streamed)


def events_of(body: str) -> list[tuple[str, dict[str, Any]]]:
    """A stream's `(event name, data)` pairs; every data's `type` is its event's name."""
    events = []
    for chunk in body.split("\n\n"):
        if not chunk.strip():
            continue
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), chunk
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        events.append((payload["type"], payload))
    return events


def check_order(events: list[tuple[str, dict[str, Any]]]) -> None:
    """message_start, ping, (pings,) blocks one after the other, message_delta, message_stop."""
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                      "message_stop"]
    open_block, next_index = None, 0
    for name, data in events[2:-2]:
        if name == "ping":
            assert open_block is None and next_index == 0, names
        elif name == "content_block_start":
            assert open_block is None and data["index"] == next_index, names
            open_block = next_index
        else:
            assert name in ("content_block_delta", "content_block_stop"), names
            assert data["index"] == open_block, names
            if name == "content_block_stop":
                open_block, next_index = None, next_index + 1
    assert open_block is None


async def raw_stream(s: Served, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    r = await s.http.post("/v1/messages", json={"model": MODEL, **body, "stream": True})
    assert r.status_code == 200, r.text
    return events_of(r.text)


def anthropic_error(r: Any, status: int, kind: str) -> str:
    """The message of an error in Anthropic's shape, after checking status and type."""
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    message: str = body["error"]["message"]
    return message


# -- the tiny Llama ----------------------------------------------------------------------------


async def test_text_plain_streamed_chat_usage_and_cache(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, "default") as s, claude(s) as client:
        body: Any = {"messages": USER, "max_tokens": 12, "extra_body": GREEDY}
        plain, streamed = await plain_and_streamed(client, **body)
        assert plain == streamed
        assert plain["stop_reason"] in ("end_turn", "max_tokens")
        [block] = plain["content"] or [{"type": "text", "text": ""}]  # early EOS: no block
        usage = plain["usage"]
        assert usage["output_tokens"] <= 12 and usage["cache_creation_input_tokens"] == 0
        events = await raw_stream(s, {"messages": USER, "max_tokens": 12, **GREEDY})
        check_order(events)
        texts = [d["delta"]["text"] for n, d in events if n == "content_block_delta"]
        assert "".join(texts) == block["text"]

        # The chat route runs the same prompt to the same answer with the same counts.
        chat = await s.http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": USER, "max_tokens": 12, **GREEDY})
        assert chat.json()["choices"][0]["message"]["content"] == block["text"]
        assert chat.json()["usage"]["prompt_tokens"] == usage["input_tokens"]
        assert chat.json()["usage"]["completion_tokens"] == usage["output_tokens"]

        # A long prompt: counted as the engine runs it, then read from the prefix cache.
        long: Any = {"system": LONG_SYSTEM, "messages": USER}
        counted = (await client.messages.count_tokens(model=MODEL, **long)).input_tokens
        first = (await client.messages.create(model=MODEL, max_tokens=2, **long)).usage
        assert (first.input_tokens, first.cache_read_input_tokens) == (counted, 0)
        again = (await client.messages.create(model=MODEL, max_tokens=2, **long)).usage
        assert again.cache_read_input_tokens is not None and again.cache_read_input_tokens > 0
        assert again.input_tokens + again.cache_read_input_tokens == counted
        async with client.messages.stream(model=MODEL, max_tokens=2, **long) as stream:
            final = (await stream.get_final_message()).usage
        assert (final.input_tokens, final.cache_read_input_tokens) == (
            again.input_tokens, again.cache_read_input_tokens)
        await check_disconnects_abort(s)


async def _leave_early(s: Served, body: dict[str, Any], chunks_before_leaving: int) -> None:
    """Post `body` to /v1/messages and disconnect after that many body chunks (0: once the
    engine holds KV blocks for it)."""
    raw = json.dumps(body).encode()
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.1"},
        "http_version": "1.1", "method": "POST", "scheme": "http", "path": "/v1/messages",
        "raw_path": b"/v1/messages", "query_string": b"", "root_path": "",
        "server": ("test", 80), "client": ("client", 1),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(raw)).encode())]}
    gone = trio.Event()
    chunks: list[bytes] = []
    sent_body = False

    async def kv_usage() -> float:
        return float((await s.engine.call_utility("get_stats"))[0]["kv_cache_usage"])

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        if chunks_before_leaving == 0:
            while await kv_usage() == 0.0:
                await trio.sleep(0.01)
            gone.set()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            if len(chunks) == chunks_before_leaving:
                gone.set()

    with trio.fail_after(5):  # far less than 400 tokens take
        await s.app(scope, receive, send)
    assert gone.is_set() and not any(b"message_stop" in chunk for chunk in chunks)


async def check_disconnects_abort(s: Served) -> None:
    long = {"model": MODEL, "messages": USER, "max_tokens": 400, **GREEDY}
    for body, chunks in (({**long, "stream": True}, 4), (long, 0)):
        await _leave_early(s, body, chunks)
        assert s.state.in_flight == 0
        assert s.engine.output_processor.get_num_unfinished_requests() == 0
        assert (await drained(s.engine))["kv_cache_usage"] == 0.0


async def test_forced_tool_calls_and_a_round_trip(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, "default", settings=AUTO) as s, claude(s) as client:
        for choice in ({"type": "any", "disable_parallel_tool_use": True},
                       {"type": "tool", "name": "get_weather"}):
            body: Any = {"messages": USER, "max_tokens": 100, "tools": [TIME, WEATHER],
                         "tool_choice": choice, "extra_body": GREEDY}
            plain, streamed = await plain_and_streamed(client, **body)
            assert plain == streamed and plain["stop_reason"] == "tool_use"
            [call] = plain["content"]
            assert call["type"] == "tool_use"
            if choice["type"] == "tool":
                assert call["name"] == "get_weather"
            schemas = {tool["name"]: tool["input_schema"] for tool in (TIME, WEATHER)}
            jsonschema.validate(call["input"], schemas[call["name"]])

        first = await client.messages.create(model=MODEL, **body)
        [call] = first.content
        assert call.type == "tool_use"
        history: Any = [*USER, {"role": "assistant", "content": first.content},
                        {"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": call.id, "content": "18C"}]}]
        answer = await client.messages.create(model=MODEL, messages=history, max_tokens=8,
                                              tools=[TIME, WEATHER], extra_body=GREEDY)
        assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
        counted = await client.messages.count_tokens(model=MODEL, messages=history,
                                                     tools=[TIME, WEATHER])
        assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) == \
            counted.input_tokens


# -- the null model, a scripted generate -------------------------------------------------------


TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}: {{ t.function.parameters "
            "| tojson }}]{% endfor %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
            "{% if m.reasoning %}(thinking {{ m.reasoning }}){% endif %}"
            "{% for c in m.tool_calls or [] %}(call {{ c.id }} {{ c.function.name }} "
            "{{ c.function.arguments | tojson }}){% endfor %}"
            "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}{% endfor %}"
            "{% if enable_thinking is defined %}[thinking {{ enable_thinking }}]{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


async def test_prompt_is_the_chat_routes(tiny_llama_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    settings = ServeSettings(served_model_name=MODEL, chat_template=TEMPLATE)
    async with serving(tiny_llama_dir, settings=settings) as s:
        run = script(monkeypatch, s.engine, ["Sunny."])
        messages = [*USER, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the tool.", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris", "unit": "c"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "18C"}, {"type": "text", "text": "dry"}]},
                {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}
            ]}]
        body: Any = {"model": MODEL, "max_tokens": 2048, "messages": messages, "tools": [WEATHER],
                "tool_choice": {"type": "none"}, "metadata": {"user_id": "u"},
                "system": [{"type": "text", "text": "Be brief."},
                           {"type": "text", "text": "Metric."}],
                "thinking": {"type": "enabled", "budget_tokens": 1024}}
        r = await s.http.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["content"] == [{"type": "text", "text": "Sunny."}]
        chat = {"model": MODEL, "messages": [
            {"role": "system", "content": "Be brief.\nMetric."}, *USER,
            {"role": "assistant", "content": "Checking.", "reasoning": "Need the tool.",
             "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18C\ndry"},
            {"role": "user", "content": "And tomorrow?"}],
            "tools": [{"type": "function", "function": {
                "name": "get_weather", "description": "Current weather", "parameters": SCHEMA}}],
            "tool_choice": "none", "chat_template_kwargs": {"enable_thinking": True}}
        assert (await s.http.post("/v1/chat/completions", json=chat)).status_code == 200
        assert run.prompts[0] == run.prompts[1]
        assert "(call toolu_1 get_weather" in run.prompts[0] and "[thinking True]" in run.prompts[0]
        counted = await s.http.post("/v1/messages/count_tokens", json=body)
        tokenized = await s.http.post("/tokenize", json={"model": MODEL, "prompt": run.prompts[0],
                                                         "add_special_tokens": False})
        assert counted.json() == {"input_tokens": tokenized.json()["count"]}
        assert r.json()["usage"]["input_tokens"] == tokenized.json()["count"]
        # A failed tool call, and the prefill of a last assistant message.
        body["messages"][2]["content"][0]["is_error"] = True
        body["messages"].append({"role": "assistant", "content": "It will"})
        body["thinking"] = {"type": "disabled"}
        assert (await s.http.post("/v1/messages", json=body)).status_code == 200
        assert "<tool>Error: 18C\ndry(for toolu_1)" in run.prompts[-1]
        assert run.prompts[-1].endswith("<assistant>It will")  # the template cuts after it


async def test_billing_header_is_stripped(tiny_llama_dir: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    assert strip_billing_line(f"{BILLING}\nYou are helpful.") == "You are helpful."
    assert strip_billing_line(BILLING) == ""
    assert strip_billing_line(f"Hi.\n{BILLING}") == f"Hi.\n{BILLING}"
    async with serving(tiny_llama_dir) as s:
        run = script(monkeypatch, s.engine, ["ok"])
        cases = [  # (with the line, the same without it)
            (f"{BILLING}\nYou are helpful.", "You are helpful."),
            ([{"type": "text", "text": BILLING}, {"type": "text", "text": "You are helpful."}],
             [{"type": "text", "text": "You are helpful."}]),
            ([{"type": "text", "text": f"{BILLING}\nYou are helpful."},
              {"type": "text", "text": "Be brief."}],
             [{"type": "text", "text": "You are helpful."}, {"type": "text", "text": "Be brief."}]),
            (BILLING, None),
        ]
        for with_line, without in cases:
            counts, prompts = [], []
            for system in (with_line, without):
                body: Any = {"model": MODEL, "messages": USER, "max_tokens": 4}
                if system is not None:
                    body["system"] = system
                r = await s.http.post("/v1/messages/count_tokens", json=body)
                counts.append(r.json()["input_tokens"])
                assert (await s.http.post("/v1/messages", json=body)).status_code == 200
                prompts.append(run.prompts[-1])
            assert counts[0] == counts[1] and prompts[0] == prompts[1], (with_line, prompts)
            assert "billing" not in prompts[0]


async def test_auto_tool_calls_parsed(tiny_llama_dir: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(tiny_llama_dir, settings=AUTO) as s, claude(s) as client:
        want = [{"type": "text", "text": "Let me check.", "citations": None},
                {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris", "unit": "c"},
                 "caller": None, "toolset_name": None},
                {"type": "tool_use", "name": "get_time", "input": {},
                 "caller": None, "toolset_name": None}]
        body: Any = {"messages": USER, "max_tokens": 200, "tools": [WEATHER, TIME]}
        for size in (1, 4, len(HERMES_REPLY)):
            run = script(monkeypatch, s.engine, pieces_of(HERMES_REPLY, size))
            plain, streamed = await plain_and_streamed(client, **body)
            assert plain == streamed
            assert plain["content"] == want and plain["stop_reason"] == "tool_use"
            assert plain["usage"]["output_tokens"] == len(run.pieces)
            assert run.params[-1].temperature == 1.0  # Anthropic's default
        events = await raw_stream(s, {**body, "tool_choice": {"type": "auto"}})
        check_order(events)
        starts = [d["content_block"] for n, d in events if n == "content_block_start"]
        assert starts[1] == {"type": "tool_use", "id": starts[1]["id"], "name": "get_weather",
                             "input": {}}
        assert starts[1]["id"] != starts[2]["id"]
        script(monkeypatch, s.engine, pieces_of(HERMES_REPLY))
        plain, streamed = await plain_and_streamed(client, **body, tool_choice={
            "type": "auto", "disable_parallel_tool_use": True})
        assert plain == streamed and plain["content"] == want[:2]
        run = script(monkeypatch, s.engine, pieces_of("No tools needed."))
        plain, streamed = await plain_and_streamed(client, **body, extra_body={
            "top_k": 5, "top_p": 0.5})
        assert plain == streamed and plain["stop_reason"] == "end_turn"
        assert (run.params[-1].top_k, run.params[-1].top_p) == (5, 0.5)


async def test_thinking_blocks(tiny_qwen3_dir: Path, tiny_llama_dir: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    reply = "<think>\nParis in June: mild.\n</think>\n\nIt is sunny."
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    body: Any = {"messages": USER, "max_tokens": 2048, "thinking": thinking}
    async with serving(tiny_qwen3_dir, reasoning_parser="qwen3") as s, claude(s) as client:
        for size in (1, 5, len(reply)):
            script(monkeypatch, s.engine, pieces_of(reply, size))
            plain, streamed = await plain_and_streamed(client, **body)
            assert plain == streamed
            assert plain["content"] == [
                {"type": "thinking", "thinking": "\nParis in June: mild.\n", "signature": ""},
                {"type": "text", "text": "\n\nIt is sunny.", "citations": None}]
            usage = plain["usage"]
            assert 0 < usage["output_tokens_details"]["thinking_tokens"] <= usage["output_tokens"]
        events = await raw_stream(s, body)
        check_order(events)
        deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
        assert {"type": "signature_delta", "signature": ""} in deltas
        assert deltas.index({"type": "signature_delta", "signature": ""}) < len(deltas) - 1
        plain, streamed = await plain_and_streamed(
            client, **{**body, "thinking": {**thinking, "display": "omitted"}})
        assert plain == streamed and plain["content"][0]["thinking"] == ""
    async with serving(tiny_llama_dir) as s, claude(s) as client:  # no reasoning parser
        script(monkeypatch, s.engine, pieces_of(reply))
        plain, streamed = await plain_and_streamed(client, **body)
        assert plain == streamed and plain["content"] == [
            {"type": "text", "text": reply, "citations": None}]


def _scripted_stop(monkeypatch: pytest.MonkeyPatch, s: Served, finish_reason: str,
                   stop_reason: int | str | None, delay: float = 0.0) -> list[SamplingParams]:
    """`generate` answers "abc" (after `delay` s) and ends with these reasons."""
    seen: list[SamplingParams] = []

    async def generate(prompt: Any, params: SamplingParams, request_id: str, *,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        seen.append(params)
        await trio.sleep(delay)
        ids = list(prompt["prompt_token_ids"])
        for i, text in enumerate(("a", "bc")):
            last = i == 1
            out = CompletionOutput(index=0, text=text, token_ids=[20],
                                   finish_reason=finish_reason if last else None,
                                   stop_reason=stop_reason if last else None)
            yield RequestOutput(request_id, prompt.get("prompt"), ids, None, [out], last)

    monkeypatch.setattr(s.engine, "generate", generate)
    return seen


async def test_stop_reasons_and_pings(tiny_llama_dir: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(tiny_llama_dir) as s, claude(s) as client:
        for finish, stop, want in (("stop", "###", ("stop_sequence", "###")),
                                   ("stop", 1, ("end_turn", None)),
                                   ("length", None, ("max_tokens", None))):
            _scripted_stop(monkeypatch, s, finish, stop)
            plain, streamed = await plain_and_streamed(client, messages=USER, max_tokens=2,
                                                       stop_sequences=["###"])
            assert plain == streamed
            assert (plain["stop_reason"], plain["stop_sequence"]) == want
        # Far more than the context holds: capped at the room left, reaching it is its own
        # stop reason.
        seen = _scripted_stop(monkeypatch, s, "length", None)
        plain, streamed = await plain_and_streamed(client, messages=USER, max_tokens=100_000)
        assert plain == streamed and plain["stop_reason"] == "model_context_window_exceeded"
        assert seen[-1].max_tokens == 512 - plain["usage"]["input_tokens"]
        _scripted_stop(monkeypatch, s, "abort", None)
        with pytest.raises(anthropic.APIStatusError) as aborted:
            await client.messages.create(model=MODEL, messages=USER, max_tokens=5)
        assert aborted.value.status_code == 529
        events = await raw_stream(s, {"messages": USER, "max_tokens": 5})
        assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "overloaded_error"

        # Pings while the first delta is awaited, none after it.
        monkeypatch.setattr(messages_stream, "PING_INTERVAL_S", 0.02)
        _scripted_stop(monkeypatch, s, "stop", None, delay=0.2)
        events = await raw_stream(s, {"messages": USER, "max_tokens": 5})
        check_order(events)
        names = [name for name, _ in events]
        assert names.count("ping") >= 3 and names.index("content_block_start") > names.index(
            "ping") and "ping" not in names[names.index("content_block_start"):]


# -- errors ------------------------------------------------------------------------------------


TOOL_USE: Any = {"role": "assistant", "content": [
    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}
BAD: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": None}, "messages"),
    ({"model": None}, "model"),
    ({"temperature": -1}, "temperature"),
    ({"logprobs": True}, "logprobs"),
    ({"messages": [{"role": "system", "content": "x"}]}, "$.messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0].type: block type 'document' is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     "messages[0].content[0]: model tiny takes text only"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "foo": 1}]}]},
     "unknown field `foo`"),
    ({"messages": [*USER, TOOL_USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
     "messages[2].content[0].tool_use_id: 'toolu_9' matches no tool_use"),
    ({"messages": [*USER, TOOL_USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}]},
     "messages[2].content[0].content[0]: image blocks are not supported yet"),
    ({"messages": [*USER, TOOL_USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "search_result"}]}]}]},
     "messages[2].content[0].content[0].type: block type 'search_result' is not supported; "
     "allowed: text"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]},
     "messages[0].content[0]: a tool_use block belongs in an assistant message"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages[0].content[0]: a tool_result block belongs in a user message"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]},
     "tools[0].type: got 'web_search_20250305', allowed: custom"),
    ({"tools": [{"name": "f"}]}, "`input_schema` - at `$.tools[0]`"),
    ({"tools": [{"name": "f", "input_schema": {}, "input_examples": [{}]}]},
     "unknown field `input_examples` - at `$.tools[0]`"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": {"type": "any"}},
     "tools[1].name: 'get_weather' is given twice"),
    ({"tools": [{"name": "", "input_schema": {}}], "tool_choice": {"type": "any"}},
     "tools[0].name: got an empty name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_time"}},
     "tool_choice.name: 'get_time' is not in tools"),
    ({"tool_choice": {"type": "any"}}, "tool_choice: type 'any' needs tools"),
    ({"tool_choice": {"type": "sometimes"}}, "$.tool_choice.type"),
    ({"tools": [WEATHER]}, AUTO_NEEDS_FLAGS),
    ({"tools": [WEATHER], "tool_choice": {"type": "auto"}}, AUTO_NEEDS_FLAGS),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}},
     "thinking.budget_tokens: got 100, allowed: at least 1024 and less than max_tokens (5)"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000}, "max_tokens": 2000},
     "thinking.budget_tokens: got 2000"),
    ({"thinking": {"type": "sometimes"}}, "$.thinking.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
     "output_config.format: cannot be combined with tool_choice"),
    ({"stop_sequences": "###"}, "$.stop_sequences"),
]


async def test_bad_input_is_anthropics_400(tiny_llama_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(tiny_llama_dir) as s, claude(s) as client:
        run = script(monkeypatch, s.engine, ["fine"])
        for fields, words in BAD:
            for stream in (False, True):
                body = {"model": MODEL, "messages": USER, "max_tokens": 5, **fields,
                        "stream": stream}
                body = {k: v for k, v in body.items() if v is not None}
                r = await s.http.post("/v1/messages", json=body)
                assert r.status_code == 400, (fields, r.text)
                message = anthropic_error(r, 400, "invalid_request_error")
                assert words in message, (fields, message)
            if "max_tokens" not in fields and "stream" not in words:
                r = await s.http.post("/v1/messages/count_tokens", json=body)
                if r.status_code != 200:
                    assert words in anthropic_error(r, 400, "invalid_request_error")
        assert run.prompts == []  # nothing reached the engine
        for raw in (b"", b"{", b"[1]"):
            r = await s.http.post("/v1/messages", content=raw)
            anthropic_error(r, 400, "invalid_request_error")
        with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
            await client.messages.create(model=MODEL, messages=USER, max_tokens=0)
        with pytest.raises(anthropic.NotFoundError, match="no-such-model"):
            await client.messages.create(model="no-such-model", messages=USER, max_tokens=5)
        r = await s.http.post("/v1/messages/count_tokens", json={"model": "x", "messages": USER})
        assert "`x` does not exist" in anthropic_error(r, 404, "not_found_error")
        # Still serving, and fields that change nothing are accepted.
        reply = await client.messages.create(
            model=MODEL, messages=USER, max_tokens=5, metadata={"user_id": "u"},
            service_tier="auto", output_config={"effort": "low"},
            extra_body={"context_management": {"edits": []}, "cache_control": {
                "type": "ephemeral"}})
        assert reply.content[0].type == "text" and reply.content[0].text == "fine"


async def test_api_key_and_overload(tiny_llama_dir: Path) -> None:
    settings = ServeSettings(served_model_name=MODEL, api_key="sk-key")
    async with serving(tiny_llama_dir, settings=settings, max_num_queued_tokens=8) as s:
        async with claude(s, "sk-key") as client:  # sent as x-api-key
            with pytest.raises(anthropic.APIStatusError) as refused:
                await client.messages.create(model=MODEL, messages=[
                    {"role": "user", "content": LONG_SYSTEM}], max_tokens=5)
            assert refused.value.status_code == 529
            error: Any = refused.value.body
            assert error["error"]["type"] == "overloaded_error"
            r = await s.http.post("/v1/messages", headers={"x-api-key": "sk-key"}, json={
                "model": MODEL, "messages": [{"role": "user", "content": LONG_SYSTEM}],
                "max_tokens": 5, "stream": True})
            assert "overloaded" in anthropic_error(r, 529, "overloaded_error")
            counted = await client.messages.count_tokens(model=MODEL, messages=USER)
            assert counted.input_tokens > 0
        async with claude(s, "wrong") as client:
            with pytest.raises(anthropic.AuthenticationError):
                await client.messages.create(model=MODEL, messages=USER, max_tokens=5)
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
            r = await s.http.post("/v1/messages", json={}, headers=headers)
            anthropic_error(r, 401, "authentication_error")
        r = await s.http.post("/v1/messages/count_tokens", headers={
            "Authorization": "Bearer sk-key"}, json={"model": MODEL, "messages": USER})
        assert r.status_code == 200, r.text


# -- a live server -----------------------------------------------------------------------------


@pytest.fixture
def live(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[Any]:
    from test_http_server import LiveServer

    with LiveServer(tiny_llama_dir, tmp_path / "server.log", ("--api-key", "sk-live")) as server:
        yield server


def test_live_server_with_the_anthropic_client(live: Any) -> None:
    client = anthropic.Anthropic(base_url=live.url, api_key="sk-live", max_retries=0)
    body: Any = {"model": MODEL, "messages": USER, "max_tokens": 8, "extra_body": GREEDY}
    plain = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        streamed = stream.get_final_message()
    assert as_dict(plain) == as_dict(streamed)
    assert plain.usage.input_tokens == client.messages.count_tokens(
        model=MODEL, messages=USER).input_tokens
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=live.url, api_key="nope", max_retries=0).messages.create(
            **body)
