"""The tool-call parsers on model texts written the way each family writes them: the
non-streamed result, and the same result however the text is split into deltas (every cut
point, and one character at a time), with each call's header before its arguments and no
markup ever in the content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ringserve.http.tool_parsers import TOOL_PARSERS, check_tool_parser, make_tool_parser
from ringserve.http.tool_parsers.base import ParsedDelta, ToolParser, merge_calls
from ringserve.http.tool_parsers.forced import NamedToolParser, RequiredToolParser

Result = tuple[str | None, list[tuple[str, Any]]]

WEATHER = {"location": "San Francisco, CA", "unit": "celsius"}
# (parser, model text, expected content, expected calls as (name, parsed arguments))
CASES: list[tuple[str, str, str | None, list[tuple[str, Any]]]] = [
    # Qwen2.5 / Qwen3: text, then blocks separated by newlines.
    ("hermes", "I'll check the weather for you.\n<tool_call>\n"
     '{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", '
     '"unit": "celsius"}}\n</tool_call>', "I'll check the weather for you.",
     [("get_current_weather", WEATHER)]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "a \\"quoted\\" '
     '{brace} </tool> café 東京", "filters": [1, {"k": null}]}}\n</tool_call>', None,
     [("get_time", {"tz": "Europe/Paris"}),
      ("search", {"query": 'a "quoted" {brace} </tool> café 東京', "filters": [1, {"k": None}]})]),
    ("hermes", "The answer is 4 < 5, and <b>no</b> tools are needed.",
     "The answer is 4 < 5, and <b>no</b> tools are needed.", []),
    ("hermes", '<tool_call>\n{"arguments": {}, "name": "ping"}\n</tool_call>\n', None,
     [("ping", {})]),
    ("hermes", '<tool_call>\n{"name": "noargs"}\n</tool_call>', None, [("noargs", {})]),
    # Llama 3.1: JSON only, with or without the python tag, several joined by ';'.
    ("llama3_json", '{"name": "get_current_weather", "parameters": {"location": '
     '"San Francisco, CA", "unit": "celsius"}}', None, [("get_current_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1.5e3}}; '
     '{"name": "b", "parameters": {"s": "semi;colon"}}', None,
     [("a", {"x": 1500.0}), ("b", {"s": "semi;colon"})]),
    ("llama3_json", '{"answer": 42, "note": "plain JSON, not a call"}',
     '{"answer": 42, "note": "plain JSON, not a call"}', []),
    ("llama3_json", "Paris is the capital of France.", "Paris is the capital of France.", []),
    ("llama3_json", '<|python_tag|>print("hi")', '<|python_tag|>print("hi")', []),
    # Mistral: text, then [TOOL_CALLS] and a JSON array.
    ("mistral", '[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"location": '
     '"San Francisco, CA", "unit": "celsius"}}, {"name": "add", "arguments": {"a": -2, '
     '"b": [true, false]}}]', None,
     [("get_current_weather", WEATHER), ("add", {"a": -2, "b": [True, False]})]),
    ("mistral", 'Let me look. [TOOL_CALLS] [{"name": "lookup", "arguments": '
     '"{\\"id\\": 7}"}]', "Let me look.", [("lookup", {"id": 7})]),
    ("mistral", "No calls [here], TOOL_CALLS is just text.",
     "No calls [here], TOOL_CALLS is just text.", []),
    # Mistral, tokenizer v11+ (Mistral Small 3.1+, Devstral): [TOOL_CALLS]name[ARGS]{...},
    # one marker per call, optionally with the model's [CALL_ID], [ARGS] absent when the
    # text was decoded without special tokens.
    ("mistral", '[TOOL_CALLS]get_current_weather[ARGS]{"location": "San Francisco, CA", '
     '"unit": "celsius"}', None, [("get_current_weather", WEATHER)]),
    ("mistral", 'Sure. [TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}[TOOL_CALLS]search'
     '[ARGS]{"query": "a [b] {c} [ARGS] café", "filters": [1, {"k": null}]}', "Sure.",
     [("get_time", {"tz": "Europe/Paris"}),
      ("search", {"query": "a [b] {c} [ARGS] café", "filters": [1, {"k": None}]})]),
    ("mistral", '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS] {"tz": "UTC"}\n'
     "[TOOL_CALLS]ping[ARGS]", None, [("get_time", {"tz": "UTC"}), ("ping", {})]),
    ("mistral", '[TOOL_CALLS]add{"a": 1, "b": 2}[TOOL_CALLS]sub{"a": 3}', None,
     [("add", {"a": 1, "b": 2}), ("sub", {"a": 3})]),
]


def expected(case: tuple[str, str, str | None, list[tuple[str, Any]]]) -> Result:
    return case[2], case[3]


def result(content: str | None, calls: list[Any]) -> Result:
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[ParsedDelta, list[ParsedDelta]]:
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    merged = ParsedDelta()
    for d in deltas:
        merged.extend(d)
    return merged, deltas


def check_stream(make: Any, text: str, want: Result, *, markers: tuple[str, ...]) -> None:
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        merged, _ = streamed(make(), pieces)
        got = result(merged.content or None, merge_calls(merged.tool_calls))
        assert got == want, pieces
        for marker in markers:
            assert marker not in merged.content
        seen: set[int] = set()
        for d in merged.tool_calls:  # the header (id, name) first, then arguments only
            if d.index not in seen:
                assert d.id and d.id.startswith("call_") and d.name and d.arguments == ""
                seen.add(d.index)
            else:
                assert d.id is None and d.name is None


MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "llama3_json": (),
           "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")}


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parser_plain_and_every_split(case: tuple[str, str, str | None, list[Any]]) -> None:
    name, text = case[0], case[1]
    content, calls = make_tool_parser(name).extract(text)
    assert result(content, calls) == expected(case)
    assert len({c.id for c in calls}) == len(calls)
    check_stream(lambda: make_tool_parser(name), text, expected(case), markers=MARKERS[name])


def test_arguments_are_the_text_the_model_wrote() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"b":1,  "a" : [2]}}\n</tool_call>'
    _, calls = make_tool_parser("hermes").extract(text)
    assert calls[0].arguments == '{"b":1,  "a" : [2]}'


def test_truncated_call_keeps_what_was_read() -> None:
    # max_tokens cut the block: the header went out, the arguments are partial.
    text = '<tool_call>\n{"name": "f", "arguments": {"city": "Par'
    content, calls = make_tool_parser("hermes").extract(text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("f", '{"city": "Par')]


def _mistral_calls(text: str) -> list[tuple[str, str]]:
    """The (name, arguments text) of the calls in `text`, checked to be the same streamed
    at every cut point and one character at a time."""
    _, calls = make_tool_parser("mistral").extract(text)
    want = [(c.name, c.arguments) for c in calls]
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        merged, _ = streamed(make_tool_parser("mistral"), pieces)
        assert [(c.name, c.arguments) for c in merge_calls(merged.tool_calls)] == want, pieces
    return want


def test_mistral_v11_arguments_are_the_text_the_model_wrote() -> None:
    # Verbatim but for the whitespace around them, as the JSON-list form sends its arguments.
    text = '[TOOL_CALLS]f[ARGS] {"b":1,  "a" : [2]}\n\n[TOOL_CALLS]g[ARGS]{}'
    assert _mistral_calls(text) == [("f", '{"b":1,  "a" : [2]}'), ("g", "{}")]


def test_mistral_invalid_json_arguments_are_sent_as_written() -> None:
    # Both forms send arguments that do not parse as the model wrote them (the client sees
    # the call the model tried to make), and the calls after them still parse.
    old = '[TOOL_CALLS][{"name": "f", "arguments": {city: Paris}}, {"name": "g"}]'
    assert _mistral_calls(old) == [("f", "{city: Paris}"), ("g", "{}")]
    new = '[TOOL_CALLS]f[ARGS]{city: Paris}[TOOL_CALLS]g[ARGS]{"ok": true}'
    assert _mistral_calls(new) == [("f", "{city: Paris}"), ("g", '{"ok": true}')]


def test_mistral_v11_cut_short() -> None:
    # max_tokens cut the arguments: the call keeps what was read; a name the end cut off
    # (no [ARGS] yet) makes no call, and none of the markup becomes content.
    assert _mistral_calls('[TOOL_CALLS]f[ARGS]{"city": "Par') == [("f", '{"city": "Par')]
    assert _mistral_calls('[TOOL_CALLS]f[ARGS]{"q": "[TOOL_') == [("f", '{"q": "[TOOL_')]
    assert _mistral_calls('[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]get_wea') == [("f", "{}")]
    for text in ("Hi [TOOL_CALLS]get_wea", "Hi [TOOL_CALLS]get_weather[AR"):
        content, calls = make_tool_parser("mistral").extract(text)
        assert (content, calls) == ("Hi", [])
    # A call with no name is not a call; the next one still is.
    assert _mistral_calls('[TOOL_CALLS]x[ARGS]{}[TOOL_CALLS] [ARGS]{"a": 1}[TOOL_CALLS]y'
                          '[ARGS]{}') == [("x", "{}"), ("y", "{}")]


def test_mistral_v11_streams_the_header_when_the_name_ends() -> None:
    parser = make_tool_parser("mistral")
    assert parser.feed("Checking.[TOOL_CALLS]get_").content == "Checking."
    assert not parser.feed("weather[AR")
    header = parser.feed('GS]{"city"').tool_calls
    assert [(d.index, d.name, d.arguments) for d in header] == [
        (0, "get_weather", ""), (0, None, '{"city"')]
    assert [d.arguments for d in parser.feed(': "Paris"}\n').tool_calls] == [': "Paris"}']
    second = parser.feed("[TOOL_CALLS]now[ARGS]").tool_calls
    assert [(d.index, d.name) for d in second] == [(1, "now")]
    assert [(d.index, d.arguments) for d in parser.finish().tool_calls] == [(1, "{}")]
    assert parser.made_calls


def test_llama3_prose_streams_at_once() -> None:
    parser = make_tool_parser("llama3_json")
    assert parser.feed("Hello").content == "Hello"
    assert parser.feed(" world").content == " world"


def test_hermes_holds_only_what_may_be_markup() -> None:
    parser = make_tool_parser("hermes")
    assert parser.feed("a <to").content == "a"
    assert parser.feed("p> b").content == " <top> b"


def test_required_and_named() -> None:
    text = ('[{"name": "get_time", "parameters": {"tz": "UTC"}}, '
            '{"parameters": {"q": "x"}, "name": "search"}]')
    want: Result = (None, [("get_time", {"tz": "UTC"}), ("search", {"q": "x"})])
    assert result(*RequiredToolParser().extract(text)) == want
    check_stream(RequiredToolParser, text, want, markers=())
    named = ' {"location": "Paris"}\n'
    want = (None, [("get_weather", {"location": "Paris"})])
    assert result(*NamedToolParser("get_weather").extract(named)) == want
    check_stream(lambda: NamedToolParser("get_weather"), named, want, markers=())
    assert NamedToolParser("f").extract(named)[1][0].arguments == '{"location": "Paris"}'


def test_registry() -> None:
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral"]
    with pytest.raises(ValueError, match=r"--tool-call-parser: got 'qwen'.*hermes, llama3_json"):
        check_tool_parser("qwen")
