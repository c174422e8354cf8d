"""`oneOf` under xgrammar (issue 45 item 6): xgrammar enforces `oneOf` as `anyOf`, so a `oneOf`
is accepted only where its branches are proven mutually exclusive (a discriminator, different
types, disjoint `const` / `enum` values), and any other is refused naming the field and where
in the schema it is. Pure schema checks (no model); the outputs of an accepted one on a model
are checked in test_constrained_generation.py."""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from ringserve.engine.structured.one_of import overlapping_branches
from ringserve.engine.structured.validation import check_structured_outputs
from ringserve.sampling_params import StructuredOutputsParams as SO


def _animal(kind: Any, **props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"kind": kind, **props},
            "required": ["kind", *props], "additionalProperties": False}


# A pydantic-style discriminated union: branches in $defs, a const / one-value enum tag.
PETS: dict[str, Any] = {
    "$defs": {"Cat": _animal({"const": "cat"}, lives={"type": "integer"}),
              "Dog": _animal({"type": "string", "enum": ["dog"]}, name={"type": "string"})},
    "type": "object",
    "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}},
    "required": ["pet"],
}

EXCLUSIVE: list[list[Any]] = [
    [{"type": "string"}, {"type": "integer"}, {"type": "null"}, {"type": "array"}],
    [{"type": ["string", "null"]}, {"type": "object"}, {"type": "boolean"}],
    [{"const": "a"}, {"const": "b"}, {"enum": ["c", 1]}],
    [{"const": True}, {"const": 1}],  # JSON Schema: true is not 1
    [{"enum": [[1, 2], {"a": 1}]}, {"enum": [[2, 1], {"a": 2}]}],
    [{"anyOf": [{"type": "string"}, {"type": "null"}]}, {"type": "number"}],
    [{"allOf": [{"type": "string"}]}, {"type": "number"}],
    [_animal({"const": "cat"}), _animal({"enum": ["dog"]}), _animal({"const": "cow"})],
    [_animal({"type": "string"}), _animal({"type": "integer"})],  # the tag's type tells
    [{"type": "string"}],  # a single branch
    [False, {"type": "string"}],
]

OVERLAPPING: list[tuple[list[Any], tuple[int, int]]] = [
    ([{"type": "integer"}, {"type": "number"}], (0, 1)),  # 1 is both
    ([{"const": 1}, {"const": 1.0}], (0, 1)),  # equal JSON numbers
    ([{"enum": ["a", "b"]}, {"enum": ["b", "c"]}], (0, 1)),
    ([{"type": "string"}, {"minimum": 3}], (0, 1)),  # the second allows any string
    ([{"type": "object", "properties": {"a": {"type": "string"}}},
      {"type": "object", "properties": {"b": {"type": "string"}}}], (0, 1)),  # {} is both
    ([_animal({"const": "cat"}), {**_animal({"const": "dog"}), "required": []}], (0, 1)),
    ([{**_animal({"const": "cat"}), "type": ["object", "null"]},
      {**_animal({"const": "dog"}), "type": ["object", "null"]}], (0, 1)),  # null is both
    ([{"type": "string"}, {"type": "null"}, {"type": ["null", "boolean"]}], (1, 2)),
    ([{"$ref": "#/$defs/missing"}, {"type": "string"}], (0, 1)),
    ([{"$ref": "#/$defs/Loop"}, {"type": "string"}], (0, 1)),
    ([True, {"type": "string"}], (0, 1)),
]


@pytest.mark.parametrize("branches", EXCLUSIVE)
def test_exclusive_branches_are_proven(branches: list[Any]) -> None:
    assert overlapping_branches({}, branches) is None


@pytest.mark.parametrize(("branches", "pair"), OVERLAPPING)
def test_overlapping_branches_are_found(branches: list[Any], pair: tuple[int, int]) -> None:
    root = {"$defs": {"Loop": {"$ref": "#/$defs/Loop"}}}
    assert overlapping_branches(root, branches) == pair


def test_refs_are_followed() -> None:
    assert overlapping_branches(PETS, PETS["properties"]["pet"]["oneOf"]) is None
    root = {"$defs": {"Cat": _animal({"const": "cat"}), "Also~cat/": _animal({"const": "cat"})}}
    assert overlapping_branches(root, [{"$ref": "#/$defs/Cat"},
                                       {"$ref": "#/$defs/Also~0cat~1"}]) == (0, 1)


def _overlap(branches: list[Any] | None = None) -> dict[str, Any]:
    return {"oneOf": branches or [{"type": "integer"}, {"type": "number"}]}


REFUSED: list[tuple[dict[str, Any], str]] = [
    (_overlap(), "#"),
    ({"type": "object", "properties": {"pet": _overlap([
        {"type": "object", "properties": {"a": {"type": "string"}}},
        {"type": "object", "properties": {"b": {"type": "string"}}}])}}, "#/properties/pet"),
    ({"type": "array", "items": _overlap()}, "#/items"),
    ({"$defs": {"N": _overlap()}, "$ref": "#/$defs/N"}, "#/$defs/N"),
    ({"definitions": {"N": _overlap()}, "type": "array", "items": {"$ref": "#/definitions/N"}},
     "#/definitions/N"),
    ({"anyOf": [{"type": "null"}, _overlap()]}, "#/anyOf/1"),
    ({"oneOf": [{"type": "null"}, _overlap()]}, "#/oneOf/1"),  # exclusive outside, not inside
]


@pytest.mark.parametrize(("schema", "path"), REFUSED)
def test_overlapping_one_of_is_refused_naming_it(schema: dict[str, Any], path: str) -> None:
    jsonschema.Draft202012Validator.check_schema(schema)
    match = (rf"^structured_outputs\.json: 'oneOf' at {re.escape(path)}: branches \d and \d "
             r"are not mutually exclusive, and the xgrammar backend enforces 'oneOf' as 'anyOf'")
    for _ in range(2):  # the second from the validation cache
        with pytest.raises(ValueError, match=match):
            check_structured_outputs(SO(json=schema))


@pytest.mark.parametrize("schema", [_overlap(), REFUSED[1][0]])
def test_guidance_refuses_them_too(schema: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: .*oneOf"):
        check_structured_outputs(SO(json=schema), "guidance")


@pytest.mark.parametrize("schema", [PETS, {"type": "array", "items": {"oneOf": EXCLUSIVE[0]}},
                                    {"oneOf": EXCLUSIVE[7]}])
def test_exclusive_one_of_is_accepted(schema: dict[str, Any]) -> None:
    check_structured_outputs(SO(json=schema))


def test_xgrammar_enforces_one_of_as_any_of() -> None:
    """Why the check exists: xgrammar's grammar for `oneOf` [integer, number] accepts `1`,
    which matches both branches, so the schema refuses it. If this ever fails, xgrammar
    compiles `oneOf` exactly and the check can go."""
    schema = _overlap()
    with pytest.raises(jsonschema.ValidationError, match="is valid under each of"):
        jsonschema.validate(1, schema)
    grammar = xgr.Grammar.from_json_schema('{"oneOf": [{"type": "integer"}, {"type": "number"}]}')
    assert xgr.testing._is_grammar_accept_string(grammar, "1")
