"""Both grammar backends (xgrammar, llguidance) on the tiny models' tokenizers: outputs sampled
from random allowed tokens satisfy their constraint, EOS is allowed exactly when the grammar
can end, the mask matches a token-at-a-time reference, and bad specs are refused naming the
field."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structured_helpers import (
    VOCAB,
    allowed,
    backend,
    generate,
    reference_mask,
    token_bytes,
    tokenizer,
)

from ringserve.engine.structured.backend import allocate_bitmask
from ringserve.engine.structured.validation import check_structured_outputs
from ringserve.sampling_params import StructuredOutputsParams as SO

BACKENDS = ["xgrammar", "guidance"]


def _json_checker(schema: Any) -> Any:
    def check(text: str) -> None:
        jsonschema.validate(json.loads(text), schema)  # strict json.loads: no raw controls
    return check


# -- generated JSON schemas -------------------------------------------------------------------

_NAMES = st.sampled_from(["a", "b", "name", "x_1", "é"])
_LEAVES = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "number"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.one_of(st.integers(-5, 5),
                                                          st.text("ab\n\"\\", max_size=3)),
                                                min_size=1, max_size=3, unique=True)),
)


def _composite(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    objects = st.dictionaries(_NAMES, children, min_size=1, max_size=3).flatmap(
        lambda props: st.builds(
            lambda req: {"type": "object", "properties": props, "required": req,
                         "additionalProperties": False},
            st.lists(st.sampled_from(sorted(props)), unique=True)))
    arrays = st.builds(lambda items, lo: {"type": "array", "items": items, "minItems": lo,
                                          "maxItems": lo + 2},
                       children, st.integers(0, 1))
    return st.one_of(objects, arrays)


SCHEMAS = st.recursive(_LEAVES, _composite, max_leaves=6)


@pytest.mark.slow  # ~2-3 s per backend (12 generated schemas)
@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_json_schema_outputs_parse_and_validate(name: str, tiny_llama_dir: Path,
                                               schema: dict[str, Any], seed: int) -> None:
    be = backend(name, tiny_llama_dir)
    compiled = be.compile(SO(json=schema))
    text = generate(be, compiled, tiny_llama_dir, random.Random(seed),
                    check_end=_json_checker(schema))
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("options", [{}, {"disable_any_whitespace": True}])
def test_json_object_is_an_object(name: str, tiny_qwen2_dir: Path, options: dict[str, Any]
                                  ) -> None:
    be = backend(name, tiny_qwen2_dir)
    compiled = be.compile(SO(json_object=True, **options))
    for seed in range(4):
        text = generate(be, compiled, tiny_qwen2_dir, random.Random(seed), free_steps=20,
                        check_end=lambda t: None if isinstance(json.loads(t), dict) else
                        pytest.fail(f"not an object: {t!r}"))
        assert isinstance(json.loads(text), dict)
        if options:
            assert not re.search(r"[ \t\n\r]", _outside_strings(text)), text


def _outside_strings(text: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("string", [{"type": "string"}, {"type": "string", "maxLength": 4},
                                    {"type": "string", "minLength": 1}])
def test_raw_control_characters_never_allowed_in_strings(name: str, tiny_llama_dir: Path,
                                                         string: dict[str, Any]) -> None:
    be = backend(name, tiny_llama_dir)
    vocab = token_bytes(tiny_llama_dir)
    matcher = be.matcher(be.compile(SO(json={"type": "object", "properties": {
        "s": string}, "required": ["s"]})))
    for token in tokenizer(tiny_llama_dir).encode('{"s": "', add_special_tokens=False):
        assert matcher.accept_token(token)
    mask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(mask, 0)
    bad = [t for t in allowed(mask[0]) if any(b < 0x20 for b in vocab[t])]
    assert not bad, [vocab[t] for t in bad]


def test_guidance_escapes_quotes_in_patterns(tiny_llama_dir: Path) -> None:
    schema = {"type": "string", "pattern": '^a"\\\\\\n$'}
    with pytest.raises(ValueError, match=r"structured_outputs\.json: .*pattern"):
        backend("xgrammar", tiny_llama_dir).compile(SO(json=schema))
    be = backend("guidance", tiny_llama_dir)
    text = generate(be, be.compile(SO(json=schema)), tiny_llama_dir, random.Random(0))
    assert json.loads(text) == 'a"\\\n'


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("pattern", [r"[a-z]{1,6}@[a-z]{1,5}\.(com|org)", r"-?\d{1,4}(\.\d{1,2})?",
                                     r"(yes|no|maybe)!{0,3}"])
def test_regex_outputs_fullmatch(name: str, tiny_llama_dir: Path, pattern: str) -> None:
    be = backend(name, tiny_llama_dir)
    compiled = be.compile(SO(regex=pattern))

    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), text
    for seed in range(3):
        text = generate(be, compiled, tiny_llama_dir, random.Random(seed), check_end=check)
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("name", BACKENDS)
def test_choice_outputs_are_a_choice(name: str, tiny_qwen2_dir: Path) -> None:
    choices = ["yes", "no", 'say "hi"\\', "é 中 😀", "no way", "a\nb"]
    be = backend(name, tiny_qwen2_dir)
    compiled = be.compile(SO(choice=choices))
    seen = set()

    def check(text: str) -> None:
        assert text in choices, text
    for seed in range(12):
        seen.add(generate(be, compiled, tiny_qwen2_dir, random.Random(seed), free_steps=0,
                          check_end=check))
    assert seen <= set(choices) and len(seen) > 1


ARITH = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9] [0-9]? | "(" expr ")"
"""


def _parses(text: str) -> bool:
    pos = 0

    def expr() -> None:
        nonlocal pos
        term()
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            term()

    def term() -> None:
        nonlocal pos
        factor()
        while pos < len(text) and text[pos] in "*/":
            pos += 1
            factor()

    def factor() -> None:
        nonlocal pos
        if text[pos:pos + 1] == "(":
            pos += 1
            expr()
            if text[pos:pos + 1] != ")":
                raise SyntaxError(pos)
            pos += 1
            return
        m = re.compile(r"[0-9]{1,2}").match(text, pos)
        if m is None:
            raise SyntaxError(pos)
        pos = m.end()

    try:
        expr()
    except SyntaxError:
        return False
    return pos == len(text)


@pytest.mark.parametrize("name", BACKENDS)
def test_ebnf_outputs_parse(name: str, tiny_llama_dir: Path) -> None:
    be = backend(name, tiny_llama_dir)
    compiled = be.compile(SO(grammar=ARITH))

    def check(text: str) -> None:
        assert _parses(text), text
    for seed in range(4):
        text = generate(be, compiled, tiny_llama_dir, random.Random(seed), check_end=check)
        assert _parses(text), text


@pytest.mark.parametrize("name", BACKENDS)
def test_eos_only_once_complete_and_rollback(name: str, tiny_llama_dir: Path) -> None:
    be = backend(name, tiny_llama_dir)
    eos = tokenizer(tiny_llama_dir).eos_token_id
    matcher = be.matcher(be.compile(SO(regex="ab(cd)?")))
    mask = allocate_bitmask(1, VOCAB)
    vocab = token_bytes(tiny_llama_dir)
    a = next(t for t in range(VOCAB) if vocab[t] == b"a")
    b = next(t for t in range(VOCAB) if vocab[t] == b"b")
    assert not matcher.accept_token(b)  # forbidden: refused, state unchanged
    assert matcher.accept_token(a)
    matcher.fill_bitmask(mask, 0)
    assert eos not in allowed(mask[0])
    assert matcher.accept_token(b)
    matcher.fill_bitmask(mask, 0)
    assert eos in allowed(mask[0])
    assert matcher.accept_token(eos) and matcher.is_terminated()
    matcher.rollback(2)
    assert not matcher.is_terminated()
    matcher.fill_bitmask(mask, 0)
    assert allowed(mask[0]) == [b]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("options", [{}, {"disable_any_whitespace": True}])
def test_mask_matches_token_at_a_time_reference(name: str, tiny_llama_dir: Path,
                                                options: dict[str, Any]) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "s": {"enum": ["ab", "c d"]}},
              "required": ["n", "s"], "additionalProperties": False}
    be = backend(name, tiny_llama_dir)
    compiled = be.compile(SO(json=schema, **options))
    matcher = be.matcher(compiled)
    eos = tokenizer(tiny_llama_dir).eos_token_id
    prefix: list[int] = []
    mask = allocate_bitmask(1, VOCAB)
    for token in [*tokenizer(tiny_llama_dir).encode('{"n":12,"s":"c d"}',
                                                    add_special_tokens=False), eos]:
        mask.fill_(-1)
        matcher.fill_bitmask(mask, 0)
        got, ref = allowed(mask[0]), allowed(reference_mask(be, compiled, prefix, VOCAB)[0])
        if name == "xgrammar":
            assert got == ref, prefix
        else:  # llguidance masks non-canonical tokenizations of forced bytes (`{` before `"`)
            assert got and set(got) <= set(ref), prefix
        assert matcher.accept_token(token)
        prefix.append(token)
    assert matcher.is_terminated()


@pytest.mark.parametrize("name", BACKENDS)
def test_padded_vocab_never_allows_ids_past_the_tokenizer(name: str, tiny_llama_dir: Path) -> None:
    be = backend(name, tiny_llama_dir, 8064)
    text = generate(be, be.compile(SO(json_object=True)), tiny_llama_dir, random.Random(1))
    assert isinstance(json.loads(text), dict)


BAD = [
    (SO(json='{"type": "foo"}'), r"structured_outputs\.json: invalid JSON schema"),
    (SO(json="{not json"), r"structured_outputs\.json: invalid JSON schema: not JSON"),
    (SO(json={"type": "integer", "minimum": 5, "maximum": 1}), r"structured_outputs\.json:"),
    (SO(json={"properties": 3}), r"structured_outputs\.json:"),
    (SO(json={"not": {"type": "integer"}}), r"structured_outputs\.json:"),
    (SO(regex="a("), r"structured_outputs\.regex: invalid regex"),
    (SO(grammar='root ::= "a" | missing'), r"structured_outputs\.grammar: invalid grammar"),
    (SO(structural_tag="{nope"), r"structured_outputs\.structural_tag: invalid structural tag"),
    (SO(json_object=True, whitespace_pattern="[ a]*"), r"structured_outputs\.whitespace_pattern"),
]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("params", "match"), BAD)
def test_bad_specs_name_the_field(name: str, tiny_llama_dir: Path, params: SO, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        backend(name, tiny_llama_dir).compile(params)
    for _ in range(2):  # the second from the cache
        with pytest.raises(ValueError, match=match):
            check_structured_outputs(params, name)


def test_backend_specific_refusals(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"structured_outputs\.whitespace_pattern: .*xgrammar"):
        check_structured_outputs(SO(json_object=True, whitespace_pattern="[ ]?"))
    check_structured_outputs(SO(json_object=True, whitespace_pattern="[ ]?"), "guidance")
    tag = _current_form({"type": "tag", "begin": "<a>", "content": {"type": "token", "token": 5},
                         "end": "</a>"})
    check_structured_outputs(SO(structural_tag=tag), "xgrammar")
    with pytest.raises(ValueError, match=r"structured_outputs\.structural_tag: .*xgrammar"):
        check_structured_outputs(SO(structural_tag=tag), "guidance")


@pytest.mark.parametrize("name", BACKENDS)
def test_legacy_structural_tag(name: str, tiny_llama_dir: Path) -> None:
    tag = json.dumps({"structures": [{"begin": "<f=x>", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        "end": "</f>"}], "triggers": ["<f="]})
    be = backend(name, tiny_llama_dir)
    matcher = be.matcher(be.compile(SO(structural_tag=tag)))
    ok = tokenizer(tiny_llama_dir).encode('hi <f=x>{"a": 1}</f>', add_special_tokens=False)
    assert all(matcher.accept_token(t) for t in ok)
    mask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(mask, 0)
    assert tokenizer(tiny_llama_dir).eos_token_id in allowed(mask[0])
    bad = be.matcher(be.compile(SO(structural_tag=tag)))
    toks = tokenizer(tiny_llama_dir).encode('<f=x>{"b"', add_special_tokens=False)
    assert not all(bad.accept_token(t) for t in toks)


# -- the current structural-tag form (issue 45 item 6) -------------------------------------------

def _current_form(fmt: dict[str, Any]) -> str:
    return json.dumps({"type": "structural_tag", "format": fmt})


def _accepts(be: Any, compiled: Any, model_dir: Path, text: str) -> bool:
    """Whether the backend's matcher takes `text` (as the tokenizer splits it), then EOS."""
    matcher = be.matcher(compiled)
    tok = tokenizer(model_dir)
    ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    return all(matcher.accept_token(t) for t in ids) and matcher.is_terminated()


_ARGS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
         "additionalProperties": False}
_CALL = {"type": "tag", "begin": "<f=weather>", "end": "</f>",
         "content": {"type": "json_schema", "json_schema": _ARGS}}
_NOTE = {"type": "tag", "begin": "<f=note>", "end": "</f>",
         "content": {"type": "any_text", "excludes": ["\n"]}}
_A, _B = {"type": "const_string", "value": "a"}, {"type": "const_string", "value": "b"}
CURRENT_FORM: list[tuple[str, dict[str, Any], list[str], list[str]]] = [
    # (type, format, texts it matches, texts it does not)
    ("const_string", {"type": "const_string", "value": "Hé\"!"}, ['Hé"!'], ["Hé", 'Hé"!!']),
    # read as xgrammar reads it: `.` takes a newline, `\w` and `\d` are ASCII
    ("regex", {"type": "regex", "pattern": r"^\w+/\d.$"}, ["ab/1\n", "c_/9x"],
     ["é/1x", "ab/٣x", "ab/1"]),
    ("any_text", {"type": "any_text", "excludes": ["no"], "max_chars": 6},
     ["", "yes!", "n o"], ["nope", "1234567"]),
    ("json_schema", {"type": "json_schema", "json_schema": _ARGS},
     ['{"city": "Paris"}', '{ "city":"" }'], ['{"city": 1}', ' {"city": "P"}', '{}']),
    ("sequence", {"type": "sequence", "elements": [{"type": "regex", "pattern": "a+"},
                                                    {"type": "const_string", "value": "ab"}]},
     ["aab", "aaaab"], ["ab", "aabb"]),  # llguidance's greedy lexer alone would refuse aab
    ("or", {"type": "or", "elements": [_CALL, _NOTE]},
     ['<f=weather>{"city": "Oslo"}</f>', "<f=note>hi</f>"], ["<f=note>a\nb</f>", ""]),
    ("optional", {"type": "optional", "content": _A}, ["", "a"], ["aa"]),
    ("star", {"type": "star", "content": _CALL},
     ["", '<f=weather>{"city": "A"}</f><f=weather>{"city": "B"}</f>'],
     ['<f=weather>{"city": "A"}</f>,']),
    ("plus", {"type": "plus", "content": _B}, ["b", "bbb"], [""]),
    ("repeat", {"type": "repeat", "min": 2, "max": 3, "content": _A}, ["aa", "aaa"],
     ["a", "aaaa"]),
    ("tag", {"type": "tag", "begin": "<think>", "content": {"type": "any_text"},
             "end": ["</think>", "</t>"]},
     ["<think>a</t>", "<think>x</think>", "<think></t>"], ["<think>a</think>b</think>"]),
    ("tag-ends-excluded-below", {"type": "tag", "begin": "(", "end": ")", "content": {
        "type": "sequence", "elements": [{"type": "any_text"}, _B]}},
     ["(ab)", "(b)"], ["(a)b)", "(ab)b)"]),  # the nearest tag's ends, at any depth
    ("triggered_tags", {"type": "triggered_tags", "triggers": ["<f="], "tags": [_CALL, _NOTE],
                        "excludes": ["!!"]},
     ["", "hi <f", 'Sure. <f=weather>{"city": "Rome"}</f> and <f=note>x</f> done'],
     ["<f=other>", '<f=weather>{"city": 1}</f>', "hey!!"]),
    ("tags_with_separator", {"type": "tags_with_separator", "tags": [_CALL, _NOTE],
                             "separator": ",", "at_least_one": True},
     ["<f=note>a</f>", '<f=note>a</f>,<f=weather>{"city": "Oslo"}</f>'],
     ["", "<f=note>a</f>,", "x<f=note>a</f>"]),
    ("dispatch", {"type": "dispatch", "rules": [["<n>", {"type": "json_schema",
                                                          "json_schema": {"type": "integer"}}],
                                                 ["<s>", {"type": "const_string", "value": "!"}]],
                  "loop": False},
     ["plain", "x<n>12", "x<s>!"], ["x<n>12 y", "x<s>?"]),
]


@pytest.mark.parametrize(("kind", "fmt", "good", "bad"), CURRENT_FORM,
                         ids=[case[0] for case in CURRENT_FORM])
def test_current_structural_tag_form(kind: str, fmt: dict[str, Any], good: list[str],
                                     bad: list[str], tiny_llama_dir: Path) -> None:
    tag = _current_form(fmt)
    check_structured_outputs(SO(structural_tag=tag), "guidance")
    for name in BACKENDS:  # xgrammar, which defines the form, gives the same verdicts
        be = backend(name, tiny_llama_dir)
        compiled = be.compile(SO(structural_tag=tag))
        for text in good:
            assert _accepts(be, compiled, tiny_llama_dir, text), (name, text)
        for text in bad:
            assert not _accepts(be, compiled, tiny_llama_dir, text), (name, text)


def test_current_structural_tag_generation(tiny_llama_dir: Path) -> None:
    """Random allowed tokens under one forced tool call: a think block, then exactly one call
    whose arguments validate."""
    fmt = {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<think>", "content": {"type": "any_text", "max_chars": 12},
         "end": "</think>"},
        {"type": "triggered_tags", "triggers": ["<f="], "tags": [_CALL],
         "at_least_one": True, "stop_after_first": True}]}
    be = backend("guidance", tiny_llama_dir)
    compiled = be.compile(SO(structural_tag=_current_form(fmt)))
    for seed in range(3):
        text = generate(be, compiled, tiny_llama_dir, random.Random(seed), free_steps=4)
        m = re.fullmatch(r"<think>((?s:.){0,12})</think><f=weather>(.*)</f>", text, re.S)
        assert m is not None and "</think>" not in m.group(1), text
        jsonschema.validate(json.loads(m.group(2)), _ARGS)


@pytest.mark.parametrize("fmt", [
    {"type": "token", "token": 5},
    {"type": "exclude_token", "exclude_tokens": [5]},
    {"type": "any_tokens"},
    {"type": "token_triggered_tags", "trigger_tokens": [5], "tags": []},
    {"type": "token_dispatch", "rules": []},
    {"type": "qwen_xml_parameter", "json_schema": _ARGS},
    {"type": "json_schema", "json_schema": _ARGS, "style": "qwen_xml"},
    {"type": "json_schema", "json_schema": _ARGS, "any_order": True},
    {"type": "any_text", "max_tokens": 8},
    {"type": "grammar", "grammar": 'root ::= "a" "bc" | "ab" "d"'},  # llguidance: not "abc"
], ids=["token", "exclude_token", "any_tokens", "token_triggered_tags", "token_dispatch",
        "qwen_xml_parameter", "style", "any_order", "max_tokens", "grammar"])
def test_unsupported_structural_tag_types_are_named(fmt: dict[str, Any],
                                                    tiny_llama_dir: Path) -> None:
    tag = _current_form({"type": "sequence", "elements": [_A, fmt]})
    kind = fmt["type"] if fmt["type"] != "json_schema" or "style" in fmt else "any_order"
    match = (rf"structured_outputs\.structural_tag: format\.elements\[1\]: .*{kind}.* is not "
             r"supported by the guidance backend .*use the xgrammar backend")
    with pytest.raises(ValueError, match=match):
        check_structured_outputs(SO(structural_tag=tag), "guidance")
    with pytest.raises(ValueError, match=match):
        backend("guidance", tiny_llama_dir).compile(SO(structural_tag=tag))


@pytest.mark.parametrize(("fmt", "text"), [
    # llguidance's lexer would read 125 as one number and never end it at 12
    ({"type": "sequence", "elements": [{"type": "json_schema",
                                        "json_schema": {"type": "integer"}},
                                       {"type": "const_string", "value": "5"}]}, "125"),
    # alternatives whose first lexemes compete: it would read a12 as "a1" then fail on 2
    ({"type": "or", "elements": [
        {"type": "sequence", "elements": [{"type": "const_string", "value": "a"},
                                          {"type": "json_schema",
                                           "json_schema": {"type": "integer"}}]},
        {"type": "sequence", "elements": [{"type": "const_string", "value": "a1"},
                                          {"type": "json_schema",
                                           "json_schema": {"type": "string"}}]}]}, "a12"),
], ids=["json-number", "alternatives"])
def test_inexact_structural_tag_compositions_are_refused(fmt: dict[str, Any], text: str,
                                                        tiny_llama_dir: Path) -> None:
    tag = _current_form(fmt)
    xg = backend("xgrammar", tiny_llama_dir)
    assert _accepts(xg, xg.compile(SO(structural_tag=tag)), tiny_llama_dir, text)
    with pytest.raises(ValueError, match=r"structured_outputs\.structural_tag: .*greedy lexer"):
        check_structured_outputs(SO(structural_tag=tag), "guidance")


def test_bitmask_layout_matches_torch_reference(tiny_llama_dir: Path) -> None:
    be = backend("guidance", tiny_llama_dir)
    matcher = be.matcher(be.compile(SO(choice=["abc"])))
    mask = allocate_bitmask(2, VOCAB)
    matcher.fill_bitmask(mask, 1)
    assert torch.all(mask[0] == -1)
    assert allowed(mask[1]) and all(token_bytes(tiny_llama_dir)[t] and
                                    b"abc".startswith(token_bytes(tiny_llama_dir)[t])
                                    for t in allowed(mask[1]))
