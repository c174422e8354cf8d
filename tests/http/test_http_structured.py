"""response_format / structured_outputs on both routes, tools and tool_choice, and the
reasoning split, through the app over the null-model engine with a scripted `generate`
(structured_harness): what reaches SamplingParams, the 400s naming the field, and OpenAI's
message and stream shapes (streamed == non-streamed). Whether the grammar mask really
constrains the model is tests/http/test_http_structured_core.py's business."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from http_app_harness import MODEL, error_of, serving, sse_events
from structured_harness import pieces_of, script

from ringserve.http.protocol import ChatCompletionRequest, CompletionRequest
from ringserve.http.sampling import structured_outputs_of
from ringserve.http.settings import ServeSettings
from ringserve.http.tool_parsers.request import AUTO_NEEDS_FLAGS, required_schema
from ringserve.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time"}}
AUTO = ServeSettings(served_model_name=MODEL, enable_auto_tool_choice=True,
                     tool_call_parser="hermes")
HERMES_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
                '"arguments": {}}\n</tool_call>')

CONSTRAINTS: list[tuple[dict[str, Any], StructuredOutputsParams | None]] = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "city", "schema": SCHEMA, "strict": True, "description": "d"}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"response_format": {"type": "structural_tag", "structures": [
        {"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}},
     StructuredOutputsParams(structural_tag=json.dumps(
         {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA,
                                                    "end": "</f>"}], "triggers": ["<f>"]},
         separators=(",", ":")))),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}},
     StructuredOutputsParams(choice=["yes", "no"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}},
     StructuredOutputsParams(grammar='root ::= "a"')),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " ?"}},
     StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?")),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     StructuredOutputsParams(json_object=True, disable_any_whitespace=True)),
    ({"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": {}}}},
     StructuredOutputsParams(structural_tag='{"type":"structural_tag","format":{}}')),
]


@pytest.mark.parametrize("fields, want", CONSTRAINTS)
def test_request_fields_become_the_constraint(fields: dict[str, Any],
                                              want: StructuredOutputsParams | None) -> None:
    chat = msgspec.json.decode(json.dumps({"messages": USER, **fields}),
                               type=ChatCompletionRequest)
    completion = msgspec.json.decode(json.dumps({"prompt": "x", **fields}),
                                     type=CompletionRequest)
    assert structured_outputs_of(chat) == want
    assert structured_outputs_of(completion) == want


async def test_constraint_reaches_the_engine(tiny_llama_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(tiny_llama_dir) as s:
        run = script(monkeypatch, s.engine, ['{"city": ', '"Paris"}'])
        fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
        for route, body in (("/v1/chat/completions", {"messages": USER}),
                            ("/v1/completions", {"prompt": "Weather:"})):
            for stream in (False, True):
                r = await s.http.post(route, json={**body, "response_format": fmt,
                                                   "stream": stream, "max_tokens": 8})
                assert r.status_code == 200, r.text
                assert run.params[-1].structured_outputs == StructuredOutputsParams(json=SCHEMA)
        r = await s.http.post("/v1/completions", json={
            "prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})
        assert run.params[-1].structured_outputs == StructuredOutputsParams(choice=["a", "b"])


BAD_CONSTRAINTS: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    # xgrammar would enforce it as anyOf: 1 matches both branches (issue 45 item 6)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "oneOf": [{"type": "integer"}, {"type": "number"}]}}}}, "structured_outputs.json"),
]


async def test_bad_constraints_are_400s(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir) as s:
        for fields, param in BAD_CONSTRAINTS:
            for route, body in (("/v1/chat/completions", {"messages": USER}),
                                ("/v1/completions", {"prompt": "x"})):
                for stream in (False, True):
                    r = await s.http.post(route, json={**body, **fields, "stream": stream})
                    assert error_of(r, 400)["param"] == param, (fields, r.text)


async def test_guidance_backend_takes_the_current_structural_tag(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 45 item 6: xgrammar's `{"type": "structural_tag", "format": ...}` under
    `--structured-outputs-config '{"backend": "guidance"}'`; a format llguidance cannot
    enforce exactly is a 400 naming it."""
    call = {"type": "tag", "begin": "<f=get_weather>", "end": "</f>",
            "content": {"type": "json_schema", "json_schema": SCHEMA}}
    fmt = {"type": "triggered_tags", "triggers": ["<f="], "tags": [call]}
    token = {"type": "sequence", "elements": [call, {"type": "token", "token": 5}]}
    routes = (("/v1/chat/completions", {"messages": USER}),
              ("/v1/completions", {"prompt": "Weather:"}))
    async with serving(tiny_llama_dir, structured_outputs_config={"backend": "guidance"}) as s:
        for route, body in routes:
            for stream in (False, True):
                r = await s.http.post(route, json={**body, "stream": stream,
                                                   "structured_outputs": {"structural_tag": {
                                                       "type": "structural_tag",
                                                       "format": token}}})
                error = error_of(r, 400)
                assert error["param"] == "structured_outputs.structural_tag", error
                assert ("format.elements[1]: token is not supported by the guidance backend"
                        in error["message"]), error
        run = script(monkeypatch, s.engine, ["ok"])  # past the engine's own check
        for route, body in routes:
            for stream in (False, True):
                r = await s.http.post(route, json={
                    **body, "stream": stream, "response_format": {"type": "structural_tag",
                                                                  "format": fmt}})
                assert r.status_code == 200, r.text
                tag = run.params[-1].structured_outputs
                assert tag is not None and json.loads(tag.spec)["format"] == fmt


BAD_TOOLS: list[tuple[dict[str, Any], str, str]] = [
    ({"tool_choice": "required"}, "tool_choice", "only with tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     "only with tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "always"}, "tool_choice", "'always'"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {
        "name": "get_time"}}}, "tool_choice", "'get_time' is not in tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "function": {
        "name": "get_weather"}}}, "tool_choice.type", "allowed: function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}], "tool_choice": "none"},
     "tools[0].type", "allowed: function"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL], "tool_choice": "required"},
     "tools[1].function.name", "twice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"},
     "tools[0].function.name", "empty"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function", "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters", "Expected"),
    ({"tools": [WEATHER_TOOL]}, "tool_choice", AUTO_NEEDS_FLAGS),
    ({"tools": [WEATHER_TOOL], "tool_choice": "auto"}, "tool_choice", AUTO_NEEDS_FLAGS),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "call_1", "type":
      "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]},
     "messages", "messages[1].tool_calls[0].function.arguments: not JSON"),
]


async def test_bad_tools_are_400s(tiny_llama_dir: Path) -> None:
    async with serving(tiny_llama_dir) as s:
        for fields, param, words in BAD_TOOLS:
            for stream in (False, True):
                r = await s.http.post("/v1/chat/completions", json={
                    "messages": USER, **fields, "stream": stream})
                error = error_of(r, 400)
                assert error["param"] == param and words in error["message"], (fields, error)
        assert AUTO_NEEDS_FLAGS == ('"auto" tool choice requires --enable-auto-tool-choice '
                                    "and --tool-call-parser to be set")  # vLLM's words


async def test_tools_and_tool_messages_reach_the_template(tiny_llama_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}(call {{ c.id }} {{ c.function.name }} "
                "{{ c.function.arguments.city }}){% endfor %}"
                "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}{% endfor %}")
    settings = ServeSettings(served_model_name=MODEL, chat_template=template)
    async with serving(tiny_llama_dir, settings=settings) as s:
        run = script(monkeypatch, s.engine, ["Sunny."])
        messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_7", "content": "18C"}]
        r = await s.http.post("/v1/chat/completions", json={
            "messages": messages, "tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": "none"})
        assert r.status_code == 200, r.text
        assert run.prompts[-1] == ("[tool get_weather][tool get_time]<user>Weather in Paris?"
                                   "<assistant>(call call_7 get_weather Paris)"
                                   "<tool>18C(for call_7)")
        message = r.json()["choices"][0]["message"]
        assert message["content"] == "Sunny." and message["tool_calls"] == []
        assert run.params[-1].structured_outputs is None


def stream_message(events: list[Any]) -> tuple[dict[str, Any], str | None]:
    """A stream's message rebuilt from its deltas, and its finish reason; checks the tool-call
    delta order (id, type and name first, then argument fragments)."""
    content, reasoning, calls, finish = "", "", {}, None
    for event in events[:-1]:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or []:
                if call["index"] not in calls:
                    assert call["id"].startswith("call_") and call["type"] == "function"
                    assert call["function"]["name"] and call["function"]["arguments"] == ""
                    calls[call["index"]] = {"name": call["function"]["name"], "arguments": ""}
                else:
                    assert set(call) == {"index", "function"}
                    assert set(call["function"]) == {"arguments"}
                calls[call["index"]]["arguments"] += call["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    message = {"content": content or None, "reasoning": reasoning or None,
               "tool_calls": [calls[i] for i in sorted(calls)]}
    return message, finish


def plain_message(body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    choice = body["choices"][0]
    message = choice["message"]
    for call in message["tool_calls"]:
        assert call["id"].startswith("call_") and call["type"] == "function"
    return ({"content": message["content"] or None, "reasoning": message["reasoning"],
             "tool_calls": [call["function"] for call in message["tool_calls"]]},
            choice["finish_reason"])


async def plain_and_streamed(s: Any, body: dict[str, Any]) -> tuple[Any, Any]:
    r = await s.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    plain = plain_message(r.json())
    r = await s.http.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    return plain, stream_message(sse_events(r.text))


async def test_auto_tool_calls_plain_and_streamed(tiny_llama_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(tiny_llama_dir, settings=AUTO) as s:
        want = ({"content": "Let me check.", "reasoning": None, "tool_calls": [
            {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"name": "get_time", "arguments": "{}"}]}, "tool_calls")
        body = {"messages": USER, "tools": [WEATHER_TOOL, TIME_TOOL]}
        for size in (1, 3, 7, len(HERMES_REPLY)):
            run = script(monkeypatch, s.engine, pieces_of(HERMES_REPLY, size))
            plain, streamed = await plain_and_streamed(s, body)
            assert plain == streamed == want, size
            assert run.params[-1].skip_special_tokens is False  # hermes keeps its markup
            assert run.params[-1].structured_outputs is None
        script(monkeypatch, s.engine, pieces_of(HERMES_REPLY))
        plain, streamed = await plain_and_streamed(s, {**body, "parallel_tool_calls": False})
        assert plain == streamed == ({**want[0], "tool_calls": want[0]["tool_calls"][:1]},
                                     "tool_calls")
        script(monkeypatch, s.engine, pieces_of("No tools needed, it is sunny."))
        plain, streamed = await plain_and_streamed(s, body)
        assert plain == streamed == ({"content": "No tools needed, it is sunny.",
                                      "reasoning": None, "tool_calls": []}, "stop")


async def test_required_and_named_tool_choice(tiny_llama_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    tools = [WEATHER_TOOL, TIME_TOOL]
    async with serving(tiny_llama_dir) as s:
        reply = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
        run = script(monkeypatch, s.engine, pieces_of(reply))
        body = {"messages": USER, "tools": tools, "tool_choice": "required"}
        plain, streamed = await plain_and_streamed(s, body)
        assert plain == streamed == ({"content": None, "reasoning": None, "tool_calls": [
            {"name": "get_weather", "arguments": '{"city": "Paris"}'}]}, "tool_calls")
        schema = run.params[-1].structured_outputs.json
        assert schema["minItems"] == 1 and "maxItems" not in schema
        assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [
            ["get_weather"], ["get_time"]]
        assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {
            "type": "object", "properties": {}}
        await s.http.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False})
        assert run.params[-1].structured_outputs.json["maxItems"] == 1

        script(monkeypatch, s.engine, pieces_of(' {"city": "Paris"} '))
        body = {"messages": USER, "tools": tools,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        plain, streamed = await plain_and_streamed(s, body)
        assert plain == streamed == ({"content": None, "reasoning": None, "tool_calls": [
            {"name": "get_weather", "arguments": '{"city": "Paris"}'}]}, "tool_calls")


def test_required_schema_accepts_calls_only() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    req = msgspec.json.decode(json.dumps({"messages": USER, "tools": [WEATHER_TOOL, TIME_TOOL]}),
                              type=ChatCompletionRequest)
    assert req.tools is not None
    schema = required_schema(req.tools, parallel=True)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}],
                [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2,
                            required_schema(req.tools, parallel=False))


async def test_reasoning_split_plain_and_streamed(tiny_qwen3_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    reply = "<think>\nParis in June: mild.\n</think>\n\nIt is sunny."
    async with serving(tiny_qwen3_dir, reasoning_parser="qwen3", settings=AUTO) as s:
        for size in (1, 4, len(reply)):
            script(monkeypatch, s.engine, pieces_of(reply, size))
            plain, streamed = await plain_and_streamed(s, {"messages": USER})
            assert plain == streamed == ({"content": "\n\nIt is sunny.",
                                          "reasoning": "\nParis in June: mild.\n",
                                          "tool_calls": []}, "stop")
        script(monkeypatch, s.engine, pieces_of("<think>Need the tool.</think>" + HERMES_REPLY))
        plain, streamed = await plain_and_streamed(s, {"messages": USER,
                                                       "tools": [WEATHER_TOOL, TIME_TOOL]})
        assert plain == streamed
        assert plain[0]["reasoning"] == "Need the tool." and len(plain[0]["tool_calls"]) == 2


async def test_no_parser_leaves_text_alone(tiny_llama_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(tiny_llama_dir) as s:
        text = "<think>x</think><tool_call>{}</tool_call>"
        script(monkeypatch, s.engine, pieces_of(text))
        plain, streamed = await plain_and_streamed(s, {"messages": USER})
        assert plain == streamed == ({"content": text, "reasoning": None, "tool_calls": []},
                                     "stop")
