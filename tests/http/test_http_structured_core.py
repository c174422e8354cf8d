"""NEEDS THE ENGINE CORE'S GRAMMAR MASK (issue 15 items 1-2): constrained requests on the tiny
random-weight Llama through the real executor. Random weights write garbage unless the mask
holds them to the grammar, so these pass only once the core enforces
`SamplingParams.structured_outputs`: json_schema replies parse and validate, tool_choice
required / named give arguments valid for the tool's schema, and streamed == non-streamed
under greedy decoding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from http_app_harness import serving, sse_events

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "days": {"type": "integer", "minimum": 0, "maximum": 9},
    "unit": {"enum": ["c", "f"]}}, "required": ["city", "days", "unit"],
    "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
             "required": ["tz"], "additionalProperties": False}}}]
USER = [{"role": "user", "content": "Weather?"}]
# No max_tokens on chat: the rest of the context; completions default to 16, so they get
# most of the 512-token context.
GREEDY: dict[str, Any] = {"temperature": 0}
LONG = {"temperature": 0, "max_tokens": 480}


def streamed_text(body: str, field: str = "content") -> str:
    text = ""
    for event in sse_events(body)[:-1]:
        for choice in event["choices"]:
            text += choice.get("delta", {}).get(field) or choice.get("text") or ""
    return text


async def test_json_schema_replies_validate(tiny_llama_dir: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    # Compact JSON: with free whitespace a random-weight model writes newlines until the
    # context ends (`response_format` reaching SamplingParams: test_http_structured.py).
    fmt = {"json": SCHEMA, "disable_any_whitespace": True}
    async with serving(tiny_llama_dir, "default") as s:
        r = await s.http.post("/v1/chat/completions", json={
            "messages": USER, "structured_outputs": fmt, **GREEDY})
        text = r.json()["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(text), SCHEMA)
        r = await s.http.post("/v1/chat/completions", json={
            "messages": USER, "structured_outputs": fmt, "stream": True, **GREEDY})
        assert streamed_text(r.text) == text
        r = await s.http.post("/v1/completions", json={
            "prompt": "Weather:", "structured_outputs": fmt, **LONG})
        jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)
        r = await s.http.post("/v1/completions", json={
            "prompt": "Pick:", "structured_outputs": {"choice": ["yes", "no"]}, **LONG})
        assert r.json()["choices"][0]["text"] in ("yes", "no")


async def test_tool_choice_required_and_named_give_valid_arguments(tiny_llama_dir: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    choices: list[Any] = ["required", {"type": "function", "function": {"name": "get_time"}}]
    async with serving(tiny_llama_dir, "default") as s:
        for choice in choices:
            # One call: with parallel calls allowed a random model keeps adding them.
            body = {"messages": USER, "tools": TOOLS, "tool_choice": choice,
                    "parallel_tool_calls": False, **GREEDY}
            r = await s.http.post("/v1/chat/completions", json=body)
            result = r.json()["choices"][0]
            assert result["finish_reason"] == "tool_calls", result
            calls = result["message"]["tool_calls"]
            assert calls
            for call in calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]),
                                    schemas[call["function"]["name"]])
            if isinstance(choice, dict):
                assert [c["function"]["name"] for c in calls] == ["get_time"]
            r = await s.http.post("/v1/chat/completions", json={**body, "stream": True})
            args = ""
            for event in sse_events(r.text)[:-1]:
                for c in event["choices"]:
                    for call in c["delta"].get("tool_calls") or []:
                        args += call["function"].get("arguments", "")
            assert args == "".join(c["function"]["arguments"] for c in calls)
