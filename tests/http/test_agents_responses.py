"""`/v1/responses` (issue 40.1): the official openai client and raw HTTP against the app on
the tiny Llama (plain and streamed text, forced tool calls whose arguments fit their schema,
a tool round trip, three turns by `previous_response_id`, usage equal to the chat route's
prompt, background runs and their cancel, a client's disconnect aborting its request), the
parsing of scripted replies on the null model (auto tool calls, reasoning items, the
conversation the chat template sees), every bad input as a 400 / 404 naming its field with
nothing reaching the engine, the bounded store, and the OpenAI Agents SDK's Runner calling a
function tool through a live `ringserve serve` (whose own nursery runs background responses).

Streams are checked event by event: `sequence_number` counts from 0, each output item is
added, filled and done in turn, the deltas join to the item's text or arguments, and the
response the stream ends with equals the plain one, ids and times aside.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
import trio
from http_app_harness import MODEL, drained, error_of, serving
from structured_harness import pieces_of, script
from test_http_server import LiveServer

from ringserve.http.settings import ServeSettings
from ringserve.http.tool_parsers.request import AUTO_NEEDS_FLAGS
from ringserve.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow  # each test starts an engine (~1.5 s; ~4 s with the model)

UNIT = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                         "days": {"enum": [1, 2, 3]}},
        "required": ["unit", "days"], "additionalProperties": False}
UNIT_TOOL = {"type": "function", "name": "pick_unit", "description": "Pick the unit",
             "parameters": UNIT, "strict": True}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather",
                "parameters": WEATHER}
TIME_TOOL = {"type": "function", "name": "get_time"}
AUTO = ServeSettings(served_model_name=MODEL, enable_auto_tool_choice=True,
                     tool_call_parser="hermes")
HERMES_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
                '"arguments": {}}\n</tool_call>')
# Several KV blocks long, so a continuation reads whole blocks from the prefix cache.
LONG = " ".join(f"word{i}" for i in range(80))
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


# -- helpers ----------------------------------------------------------------------------------


def named_events(body: str) -> list[dict[str, Any]]:
    """The events of a Responses stream; each `event:` line names its data's type."""
    events = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: "):])
        assert event["type"] == head[len("event: "):]
        events.append(event)
    return events


def _check_item(events: list[dict[str, Any]], i: int, index: int) -> tuple[dict[str, Any], int]:
    """One output item's events from `i`: added, its parts and deltas, done."""
    start = i
    added = events[i]
    assert added["type"] == "response.output_item.added" and added["output_index"] == index
    item = added["item"]
    assert item["status"] == "in_progress"
    i += 1
    if item["type"] == "function_call":
        assert item["arguments"] == "" and item["call_id"] and item["name"]
        kinds = ("response.function_call_arguments.delta",
                 "response.function_call_arguments.done")
    else:
        assert item["content"] == []
        name = "output_text" if item["type"] == "message" else "reasoning_text"
        part = events[i]
        assert part["type"] == "response.content_part.added" and part["part"]["text"] == ""
        assert part["part"]["type"] == name
        i += 1
        kinds = (f"response.{name}.delta", f"response.{name}.done")
    text = ""
    while events[i]["type"] == kinds[0]:
        text += events[i]["delta"]
        i += 1
    done = events[i]
    assert done["type"] == kinds[1]
    assert done.get("text", done.get("arguments")) == text
    i += 1
    if item["type"] != "function_call":
        assert events[i]["type"] == "response.content_part.done"
        assert events[i]["part"]["text"] == text
        i += 1
    final = events[i]
    for event in events[start:i + 1]:
        assert event.get("item_id", item["id"]) == item["id"]
        assert event["output_index"] == index
    assert final["type"] == "response.output_item.done" and final["output_index"] == index
    got = final["item"]
    assert got["id"] == item["id"] and got["type"] == item["type"]
    if item["type"] == "function_call":
        assert got["arguments"] == text and got["call_id"] == item["call_id"]
    else:
        assert got["content"][0]["text"] == text
    return got, i + 1


def check_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Check a stream's events (see the module's docstring); its final response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    assert events[-1]["type"] in TERMINAL
    items: list[dict[str, Any]] = []
    i = 2
    while i < len(events) - 1:
        item, i = _check_item(events, i, len(items))
        items.append(item)
    final: dict[str, Any] = events[-1]["response"]
    assert final["output"] == items
    assert events[-1]["type"] == f"response.{final['status']}"
    return final


def same(response: dict[str, Any], scripted: bool = False) -> Any:
    """The response without what differs between two runs: ids, times, the prefix-cache
    hit (the second run reads the first's prompt), and usage for a scripted reply (one
    token per piece)."""
    ignored = ("id", "call_id", "created_at", "completed_at", "cached_tokens",
               *(("usage",) if scripted else ()))

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ignored}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(response)


async def plain_and_streamed(s: Any, body: dict[str, Any]) -> tuple[dict[str, Any],
                                                                   dict[str, Any]]:
    """The plain response and the streamed one (checked), as JSON."""
    r = await s.http.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    streamed = await s.http.post("/v1/responses", json={"model": MODEL, **body, "stream": True})
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers["content-type"].startswith("text/event-stream")
    plain: dict[str, Any] = r.json()
    return plain, check_stream(named_events(streamed.text))


def constraint(params: SamplingParams) -> StructuredOutputsParams:
    assert params.structured_outputs is not None
    return params.structured_outputs


def output_kinds(response: dict[str, Any]) -> list[str]:
    return [item["type"] for item in response["output"]]


async def leave_early(s: Any, body: dict[str, Any], events_before_leaving: int) -> list[bytes]:
    """POST `body` to /v1/responses through the ASGI app as a server would, and disconnect
    after that many body chunks (0: once the engine runs the request); the chunks got."""
    raw = json.dumps({"model": MODEL, **body}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.1"},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/responses", "raw_path": b"/v1/responses", "query_string": b"",
             "root_path": "", "server": ("test", 80), "client": ("client", 1),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}
    gone = trio.Event()
    chunks: list[bytes] = []
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": raw, "more_body": False}
        if events_before_leaving == 0:
            while not (await s.engine.call_utility("get_stats"))[0]["num_running_reqs"]:
                await trio.sleep(0.005)
            gone.set()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            if len(chunks) == events_before_leaving:
                gone.set()

    with trio.fail_after(10):
        await s.app(scope, receive, send)
    return chunks


# -- the tiny Llama -------------------------------------------------------------------------


async def test_text_plain_and_streamed(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, "default") as s:
        client: Any = s.openai()  # typed loosely: the bodies are plain dicts
        body = {"input": "Once upon a time", "max_output_tokens": 8, "temperature": 0.0,
                "instructions": "Tell a story.", "metadata": {"k": "v"}}
        plain, streamed = await plain_and_streamed(s, body)
        assert same(plain) == same(streamed)
        assert plain["id"].startswith("resp_") and plain["object"] == "response"
        assert plain["output"][0]["id"].startswith("msg_")
        assert plain["instructions"] == "Tell a story." and plain["metadata"] == {"k": "v"}
        assert plain["temperature"] == 0.0 and plain["max_output_tokens"] == 8
        usage = plain["usage"]
        if plain["status"] == "incomplete":  # the random model rarely ends by itself
            assert plain["incomplete_details"] == {"reason": "max_output_tokens"}
            assert usage["output_tokens"] == 8
            assert plain["output"][0]["status"] == "incomplete"
        else:
            assert plain["status"] == "completed" and usage["output_tokens"] <= 8
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]

        # The client parses both; output_text is the message's text.
        parsed = await client.responses.create(model=MODEL, **body)
        assert parsed.output_text == plain["output"][0]["content"][0]["text"]
        events = [e async for e in await client.responses.create(
            model=MODEL, stream=True, **body)]
        assert events[-1].response.output_text == parsed.output_text

        # A forced call ends the reply, so the stream helper gets response.completed.
        async with client.responses.stream(
                model=MODEL, input="Pick a unit.", tools=[UNIT_TOOL],
                tool_choice={"type": "function", "name": "pick_unit"},
                temperature=0.0) as stream:
            final = await stream.get_final_response()
        assert final.status == "completed" and final.output_text == ""
        call = final.output[0]
        assert call.type == "function_call" and call.parsed_arguments is not None
        jsonschema.validate(call.parsed_arguments, UNIT)

        # text.format: the output is JSON of the schema (when the cap does not cut it).
        fmt = {"type": "json_schema", "name": "unit", "schema": UNIT, "strict": True}
        r = await client.responses.create(model=MODEL, input="Pick a unit.", temperature=0.0,
                                          text={"format": fmt},
                                          max_output_tokens=64)
        assert r.text is not None and r.text.format is not None
        assert r.text.format.type == "json_schema"
        if r.status == "completed":
            jsonschema.validate(json.loads(r.output_text), UNIT)


SCHEMAS = {"pick_unit": UNIT, "get_time": {"type": "object", "properties": {}}}


def _call_of(response: dict[str, Any]) -> dict[str, Any]:
    """The response's one function call, whose arguments fit its tool's schema."""
    assert output_kinds(response) == ["function_call"], response["output"]
    call: dict[str, Any] = response["output"][0]
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert call["status"] == "completed"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    return call


async def test_forced_tool_calls_and_a_round_trip(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, "default") as s:
        question = [{"role": "user", "content": "Which unit for Paris?"}]
        for choice in ("required", {"type": "function", "name": "pick_unit"}):
            body = {"input": question, "tools": [UNIT_TOOL, TIME_TOOL], "tool_choice": choice,
                    "parallel_tool_calls": False, "temperature": 0.0}
            plain, streamed = await plain_and_streamed(s, body)
            assert same(plain) == same(streamed)
            assert plain["status"] == "completed" and plain["tool_choice"] == choice
            call = _call_of(plain)
            assert _call_of(streamed)["arguments"] == call["arguments"]
            assert isinstance(choice, str) or call["name"] == "pick_unit"
            assert [t["name"] for t in plain["tools"]] == ["pick_unit", "get_time"]

        # The round trip: the call's output continues the stored conversation.
        answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "22C"}
        r = await s.http.post("/v1/responses", json={
            "model": MODEL, "previous_response_id": plain["id"], "input": [answer],
            "max_output_tokens": 4, "temperature": 0.0})
        assert r.status_code == 200, r.text
        stateful = r.json()
        assert output_kinds(stateful) == ["message"]
        assert stateful["previous_response_id"] == plain["id"]
        items = (await s.http.get(f"/v1/responses/{stateful['id']}/input_items",
                                  params={"order": "asc"})).json()
        assert [i["type"] for i in items["data"]] == ["message", "function_call",
                                                      "function_call_output"]
        assert items["data"][1] == call and items["data"][2]["output"] == "22C"

        # Codex-style: the whole history each turn, nothing stored, the same prompt.
        r = await s.http.post("/v1/responses", json={
            "model": MODEL, "input": [*question, call, answer], "store": False,
            "max_output_tokens": 4, "temperature": 0.0})
        stateless = r.json()
        assert stateless["usage"]["input_tokens"] == stateful["usage"]["input_tokens"]
        assert stateless["output"][0]["content"] == stateful["output"][0]["content"]
        assert error_of(await s.http.get(f"/v1/responses/{stateless['id']}"), 404)


async def test_three_turns_by_previous_response_id(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, "default") as s:
        client: Any = s.openai()  # typed loosely: the bodies are plain dicts
        said = [LONG, "And then?", "How did it end?"]
        responses = []
        previous = None
        for text in said:
            r = await client.responses.create(model=MODEL, input=text, max_output_tokens=6,
                                              temperature=0.0, previous_response_id=previous)
            responses.append(r)
            previous = r.id
        inputs = [r.usage.input_tokens for r in responses if r.usage is not None]
        assert inputs[0] < inputs[1] < inputs[2]
        # Turn 2's prompt starts with turn 1's: read from the prefix cache.
        second = responses[1].usage
        assert second is not None and second.input_tokens_details.cached_tokens > 0

        items = [item async for item in client.responses.input_items.list(
            responses[2].id, order="asc", limit=2)]  # three pages, followed by `after`
        assert [(i.type, getattr(i, "role", None)) for i in items] == [
            ("message", "user"), ("message", "assistant")] * 2 + [("message", "user")]
        texts = [i.content[0].text for i in items]
        assert texts[::2] == said and texts[1::2] == [r.output_text for r in responses[:2]]
        newest = [item async for item in client.responses.input_items.list(responses[2].id)]
        assert [i.id for i in newest] == [i.id for i in items][::-1]  # desc by default

        # The prompt is the chat route's for the same conversation, token for token.
        messages = [{"role": "user" if k % 2 == 0 else "assistant", "content": t}
                    for k, t in enumerate(texts)]
        chat = await s.http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": 1})
        assert chat.json()["usage"]["prompt_tokens"] == inputs[2]

        fetched = await client.responses.retrieve(responses[2].id)
        assert fetched.output_text == responses[2].output_text
        assert fetched.previous_response_id == responses[1].id


async def test_background_and_cancel(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir, "default", max_model_len=2048) as s:
        client: Any = s.openai()  # typed loosely: the bodies are plain dicts
        done = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=4,
                                             background=True)
        assert done.status in ("queued", "in_progress") and done.background
        while done.status in ("queued", "in_progress"):
            await trio.sleep(0.02)
            done = await client.responses.retrieve(done.id)
        assert done.status in ("completed", "incomplete") and done.usage is not None
        assert 0 < done.usage.output_tokens <= 4

        before = (await drained(s.engine))["step_counter"]
        # Greedy on this prompt, the tiny model does not end by itself within 1900 tokens.
        long = await client.responses.create(model=MODEL, input="Once upon a time",
                                             max_output_tokens=1900, temperature=0.0,
                                             background=True)
        for _ in range(500):  # until the engine runs it
            stats = (await s.engine.call_utility("get_stats"))[0]
            if stats["num_running_reqs"]:
                break
            await trio.sleep(0.005)
        assert (await client.responses.retrieve(long.id)).status == "in_progress"
        assert s.state.in_flight == 1  # the run counts itself, so a drain waits for it
        cancelled = await client.responses.cancel(long.id)
        assert cancelled.status == "cancelled"
        after = (await drained(s.engine))["step_counter"]
        assert after - before < 1900  # aborted, not run to its end
        assert (await client.responses.retrieve(long.id)).status == "cancelled"
        assert s.state.in_flight == 0
        again = await client.responses.cancel(long.id)  # finished: answered as it is
        assert again.status == "cancelled"

        # A client that leaves aborts its request, streamed (after the text's first delta)
        # or plain (once the engine runs it); neither is stored.
        for stream, leave_after in ((True, 5), (False, 0)):
            before = (await drained(s.engine))["step_counter"]
            chunks = await leave_early(s, {"input": "Once upon a time", "stream": stream,
                                           "max_output_tokens": 1900, "temperature": 0.0},
                                       leave_after)
            assert not any(b"response.incomplete" in chunk for chunk in chunks)
            assert (await drained(s.engine))["step_counter"] - before < 1900
            assert s.state.in_flight == 0
        assert s.engine.output_processor.get_num_unfinished_requests() == 0

        plain = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
        r = await s.http.post(f"/v1/responses/{plain.id}/cancel")
        assert "background" in error_of(r, 400)["message"]
        r = await s.http.post("/v1/responses", json={"model": MODEL, "input": "Hi",
                                                     "background": True, "stream": True})
        assert error_of(r, 400)["param"] == "background"


# -- scripted replies on the null model --------------------------------------------------


async def test_auto_tool_calls_plain_and_streamed(tiny_llama_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(tiny_llama_dir, settings=AUTO) as s:
        body = {"input": "Weather in Paris?", "tools": [WEATHER_TOOL, TIME_TOOL]}
        for size in (1, 3, 7, len(HERMES_REPLY)):
            run = script(monkeypatch, s.engine, pieces_of(HERMES_REPLY, size))
            plain, streamed = await plain_and_streamed(s, body)
            assert same(plain, True) == same(streamed, True), size
            assert output_kinds(plain) == ["message", "function_call", "function_call"]
            assert plain["output"][0]["content"][0]["text"] == "Let me check."
            assert [(c["name"], c["arguments"]) for c in plain["output"][1:]] == [
                ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
            assert plain["status"] == "completed" and plain["tool_choice"] == "auto"
            assert run.params[-1].structured_outputs is None
        script(monkeypatch, s.engine, pieces_of(HERMES_REPLY))
        plain, streamed = await plain_and_streamed(s, {**body, "parallel_tool_calls": False})
        assert output_kinds(plain) == output_kinds(streamed) == ["message", "function_call"]
        script(monkeypatch, s.engine, [""])  # no text at all: still an (empty) message
        plain, streamed = await plain_and_streamed(s, body)
        assert output_kinds(plain) == ["message"] and same(plain, True) == same(streamed, True)
        assert plain["output"][0]["content"][0]["text"] == ""

        # A forced choice's constraint reaches the engine; text.format becomes one too.
        run = script(monkeypatch, s.engine, ['{"city": "Paris"}'])
        r = await s.http.post("/v1/responses", json={
            **body, "tool_choice": {"type": "function", "name": "get_weather"}})
        assert constraint(run.params[-1]).json == WEATHER
        assert r.json()["output"][0]["arguments"] == '{"city": "Paris"}'
        fmt = {"type": "json_schema", "name": "w", "schema": WEATHER}
        r = await s.http.post("/v1/responses", json={"input": "x", "text": {"format": fmt}})
        assert constraint(run.params[-1]).json == WEATHER
        assert r.json()["text"]["format"] == fmt
        await s.http.post("/v1/responses", json={"input": "x", "text": {
            "format": {"type": "json_object"}}})
        assert constraint(run.params[-1]).json_object


async def test_reasoning_items(tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch,
                               caplog: pytest.LogCaptureFixture) -> None:
    reply = "<think>\nParis in June: mild.\n</think>\n\nIt is sunny."
    async with serving(tiny_qwen3_dir, reasoning_parser="qwen3", settings=AUTO) as s:
        for size in (1, 4, len(reply)):
            script(monkeypatch, s.engine, pieces_of(reply, size))
            with caplog.at_level(logging.INFO, "ringserve.http.agents.responses_route"):
                plain, streamed = await plain_and_streamed(s, {
                    "input": "Weather?", "reasoning": {"effort": "high", "summary": "auto"}})
            assert same(plain, True) == same(streamed, True)
            reasoning, message = plain["output"]
            assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
            assert reasoning["content"] == [{"type": "reasoning_text",
                                             "text": "\nParis in June: mild.\n"}]
            assert reasoning["summary"] == []
            assert message["content"][0]["text"] == "\n\nIt is sunny."
            assert plain["reasoning"]["effort"] == "high"
            assert plain["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
        said = [r for r in caplog.records if "reasoning.effort" in r.getMessage()]
        assert len(said) <= 1  # once per process (another test may have said it already)

        # Reasoning then calls: the items follow each other.
        script(monkeypatch, s.engine, pieces_of("<think>Need the tool.</think>" + HERMES_REPLY))
        plain, streamed = await plain_and_streamed(s, {"input": "Weather?",
                                                       "tools": [WEATHER_TOOL, TIME_TOOL]})
        assert same(plain, True) == same(streamed, True)
        assert output_kinds(plain) == ["reasoning", "message", "function_call", "function_call"]


TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
            "{% for m in messages %}<{{ m.role }}"
            "{% if m.reasoning %} thinking={{ m.reasoning }}{% endif %}>{{ m.content }}"
            "{% for c in m.tool_calls or [] %}(call {{ c.id }} {{ c.function.name }} "
            "{{ c.function.arguments.city }}){% endfor %}"
            "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}{% endfor %}")


async def test_the_conversation_the_template_sees(tiny_llama_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    settings = ServeSettings(served_model_name=MODEL, chat_template=TEMPLATE)
    async with serving(tiny_llama_dir, settings=settings) as s:
        run = script(monkeypatch, s.engine, ["Sunny."])
        conversation = [
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                         {"type": "input_text", "text": "in Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "use the tool"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                               "annotations": []}], "status": "completed"},
            {"type": "function_call", "call_id": "call_7", "name": "get_weather",
             "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
            {"type": "function_call_output", "call_id": "call_7", "output": "18C"}]
        r = await s.http.post("/v1/responses", json={
            "input": conversation, "instructions": "You are a weather bot.",
            "tools": [WEATHER_TOOL], "tool_choice": "none"})
        assert r.status_code == 200, r.text
        assert run.prompts[-1] == (
            "[tool get_weather]<system>You are a weather bot.<system>Be brief."
            "<user>Weather\nin Paris?<assistant thinking=use the tool>Checking."
            "(call call_7 get_weather Paris)<tool>18C(for call_7)")
        first = r.json()
        assert first["output"][0]["content"][0]["text"] == "Sunny."

        # The continuation: instructions are not carried over, the items are.
        r = await s.http.post("/v1/responses", json={
            "input": "Tomorrow?", "previous_response_id": first["id"]})
        assert run.prompts[-1].startswith("<system>Be brief.<user>Weather")
        assert run.prompts[-1].endswith("<assistant>Sunny.<user>Tomorrow?")
        items = (await s.http.get(f"/v1/responses/{r.json()['id']}/input_items",
                                  params={"order": "asc", "limit": 100})).json()
        assert items["object"] == "list" and not items["has_more"]
        assert [i["type"] for i in items["data"]] == [
            "message", "message", "reasoning", "message", "function_call",
            "function_call_output", "message", "message"]
        assert items["first_id"] == items["data"][0]["id"]
        assert items["last_id"] == items["data"][-1]["id"]
        assert items["data"][4]["id"] == "fc_1"
        assert items["data"][1]["content"] == [
            {"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "in Paris?"}]


STORE_OF_TWO = ServeSettings(served_model_name=MODEL, responses_store_max_entries=2)


async def test_store_bound_delete_and_store_false(tiny_llama_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(tiny_llama_dir, settings=STORE_OF_TWO) as s:
        script(monkeypatch, s.engine, ["ok"])
        ids = []
        for _ in range(3):
            r = await s.http.post("/v1/responses", json={"input": "hi"})
            ids.append(r.json()["id"])
        error = error_of(await s.http.get(f"/v1/responses/{ids[0]}"), 404)
        assert ids[0] in error["message"]
        r = await s.http.post("/v1/responses", json={"input": "hi",
                                                     "previous_response_id": ids[0]})
        error = error_of(r, 404)
        assert error["param"] == "previous_response_id" and ids[0] in error["message"]
        error = error_of(await s.http.get(f"/v1/responses/{ids[0]}/input_items"), 404)
        assert ids[0] in error["message"]
        assert (await s.http.get(f"/v1/responses/{ids[2]}")).json()["id"] == ids[2]

        r = await s.http.delete(f"/v1/responses/{ids[2]}")
        assert r.json() == {"id": ids[2], "object": "response.deleted", "deleted": True}
        assert error_of(await s.http.get(f"/v1/responses/{ids[2]}"), 404)
        assert error_of(await s.http.delete(f"/v1/responses/{ids[2]}"), 404)
        await s.openai().responses.delete(ids[1])  # the client takes the answer too

        r = await s.http.post("/v1/responses", json={"input": "hi", "store": False})
        assert r.json()["store"] is False
        assert error_of(await s.http.get(f"/v1/responses/{r.json()['id']}"), 404)

        r = await s.http.post("/v1/responses", json={"input": "hi"})
        page = f"/v1/responses/{r.json()['id']}/input_items"
        for query, param in (({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"),
                             ({"order": "up"}, "order"), ({"after": "msg_x"}, "after")):
            assert error_of(await s.http.get(page, params=query), 400)["param"] == param


BAD: list[tuple[dict[str, Any], int, str | None, str]] = [
    ({}, 400, "input", "required"),
    ({"input": []}, 400, "input", "at least one"),
    ({"input": 5}, 400, "input", "Expected"),
    ({"input": [{"type": "bogus"}]}, 400, "input[0].type", "'bogus'"),
    ({"input": [{"content": "x"}]}, 400, "input[0].type", "None"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role", "'robot'"),
    ({"input": [{"role": "user"}]}, 400, "input[0].content", "required"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     400, "input", "input[0].content[0]: model tiny takes text only"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     400, "input[0].content[0].type", "not supported yet"),
    ({"input": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
     400, "input[0].content[0].type", "'refusal'"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]},
     400, "input[0].call_id", "call_nope"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
     400, "input[0].arguments", "not JSON"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 1}]},
     400, "input[0].arguments", "Expected"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type", "function"),
    ({"input": "x", "tools": [{"type": "function"}]}, 400, "tools[0].name", "required"),
    ({"input": "x", "tools": [{"type": "function", "name": ""}], "tool_choice": "none"},
     400, "tools[0].name", "empty"),
    ({"input": "x", "tools": [TIME_TOOL, TIME_TOOL], "tool_choice": "none"},
     400, "tools[1].name", "twice"),
    ({"input": "x", "tools": [{**TIME_TOOL, "defer_loading": True}]},
     400, "tools[0].defer_loading", "not supported"),
    ({"input": "x", "tools": [TIME_TOOL], "tool_choice": {"type": "function",
                                                          "name": "absent"}},
     400, "tool_choice", "'absent' is not in tools"),
    ({"input": "x", "tools": [TIME_TOOL], "tool_choice": "always"}, 400, "tool_choice",
     "'always'"),
    ({"input": "x", "tools": [TIME_TOOL], "tool_choice": {"type": "file_search"}},
     400, "tool_choice.type", "function"),
    ({"input": "x", "tools": [TIME_TOOL], "tool_choice": {"type": "function"}},
     400, "tool_choice.name", "required"),
    ({"input": "x", "tool_choice": "required"}, 400, "tool_choice", "only with tools"),
    ({"input": "x", "tools": [TIME_TOOL]}, 400, "tool_choice", AUTO_NEEDS_FLAGS),
    ({"input": "x", "tools": [TIME_TOOL], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, 400, "tool_choice", "text.format"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format.type", "'yaml'"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}},
     400, "text.format.schema", "required"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
     400, "text.format.name", "required"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                        "schema": {"type": "bogus"}}}},
     400, "text.format.schema", ""),
    ({"input": "x", "text": {"format": {"type": "text"}, "tone": "dry"}},
     400, "text.tone", "not supported"),
    ({"input": "x", "ignore_eos": True}, 400, "ignore_eos", "not supported"),
    ({"input": "x", "top_logprobs": 2}, 400, "top_logprobs", "not supported"),
    ({"input": "x", "conversation": "conv_1"}, 400, "conversation", "not supported"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, 400, "include",
     "logprobs"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation", "'auto'"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens", ">= 1"),
    ({"input": "x", "max_output_tokens": 100000}, 400, "max_output_tokens", "context"),
    ({"input": "x", "temperature": -1}, 400, "temperature", "temperature"),
    ({"input": "x", "model": "nope"}, 404, "model", "nope"),
    ({"input": "x", "previous_response_id": "resp_gone"}, 404, "previous_response_id",
     "resp_gone"),
    ({"input": "x", "background": True, "store": False}, 400, "background", "store"),
]


async def test_bad_inputs_are_refused_before_the_engine(tiny_llama_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    async with serving(tiny_llama_dir) as s:
        run = script(monkeypatch, s.engine, ["fine"])
        for body, status, param, words in BAD:
            for stream in (False, True):
                r = await s.http.post("/v1/responses", json={**body, "stream": stream})
                error = error_of(r, status)
                assert error["param"] == param and words in error["message"], (body, error)
        for path in ("/v1/responses/resp_nope", "/v1/responses/resp_nope/input_items"):
            error = error_of(await s.http.get(path), 404)
            assert "resp_nope" in error["message"] and error["param"] == "response_id"
        error = error_of(await s.http.post("/v1/responses/resp_nope/cancel"), 404)
        assert "resp_nope" in error["message"]
        assert run.params == []  # nothing reached the engine
        with pytest.raises(openai.BadRequestError, match="takes text only"):
            await s.openai().responses.create(model=MODEL, input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": "http://x/y.png", "detail": "auto"}]}])
        # The no-op fields are accepted and the server keeps serving.
        r = await s.http.post("/v1/responses", json={
            "input": "x", "include": [], "truncation": "disabled", "service_tier": "auto",
            "prompt_cache_key": "k", "safety_identifier": "u", "user": "me",
            "stream_options": {"include_obfuscation": False},
            "text": {"format": {"type": "text"}, "verbosity": "low"},
            "reasoning": {"effort": "low"}})
        assert r.status_code == 200, r.text
        assert r.json()["output"][0]["content"][0]["text"] == "fine"
        assert len(run.params) == 1


# -- the OpenAI Agents SDK through a live server ----------------------------------------------


async def _run_agent(url: str) -> tuple[list[str], str, list[str]]:
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.models.openai_responses import OpenAIResponsesModel

    calls: list[str] = []

    @function_tool
    def pick_unit(unit: Literal["celsius", "fahrenheit"]) -> str:
        """Pick the temperature unit for the forecast."""
        calls.append(unit)
        return f"using {unit}"

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="Pick a unit, then stop.", tools=[pick_unit],
                  model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="pick_unit", max_tokens=32,
                                               temperature=0.0),
                  tool_use_behavior="stop_on_first_tool")
    result = await Runner.run(agent, "Which unit for Paris?", max_turns=2)
    streamed = Runner.run_streamed(agent, "And for Boston?", max_turns=2)
    kinds: list[str] = [event.type async for event in streamed.stream_events()]
    assert streamed.final_output == f"using {calls[-1]}"
    schema = pick_unit.params_json_schema
    for unit in calls:
        jsonschema.validate({"unit": unit}, schema)
    # The server's own background nursery runs background responses.
    polled = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                           background=True)
    while polled.status in ("queued", "in_progress"):
        await asyncio.sleep(0.02)
        polled = await client.responses.retrieve(polled.id)
    assert polled.status in ("completed", "incomplete")
    await client.close()
    return calls, str(result.final_output), kinds


def test_agents_sdk_runner_calls_a_function_tool(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with LiveServer(tiny_llama_dir, tmp_path / "serve.log") as server:
        calls, final, kinds = asyncio.run(_run_agent(server.url))
    assert len(calls) == 2 and final == f"using {calls[0]}"
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
