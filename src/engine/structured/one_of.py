"""Which JSON-schema `oneOf`s a grammar that treats `oneOf` as `anyOf` still enforces exactly.

xgrammar compiles `oneOf` as `anyOf`: a value matching two branches passes the grammar although
the schema forbids it. Where no value can match two branches, `anyOf` and `oneOf` accept the
same values and the grammar is exact. `overlapping_branches` looks for a pair of branches it
cannot prove mutually exclusive; the xgrammar backend (`xgrammar_backend`) refuses a `oneOf`
that has one. Pure functions over the decoded schema (no xgrammar), tested as such.

A pair of branches is proven exclusive, without enumerating values, when:
- their JSON types do not meet (`integer` counts as a `number`), from `type`, `const` or `enum`;
- both allow finitely many values (`const`, `enum`) and none in common (JSON equality: `1` and
  `1.0` are equal, `true` and `1` are not);
- both are objects that require the same property and that property's schemas are exclusive (a
  discriminator: `{"kind": {"const": "cat"}}` against `{"kind": {"const": "dog"}}`);
- one is a union (`anyOf` / `oneOf`) every member of which is exclusive with the other, or has an
  `allOf` member that is.
Local `$ref`s (`#`, `#/$defs/...`, `#/definitions/...`) are followed; anything else is taken to
allow every value, so the answer errs towards "may overlap", never the other way.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

__all__ = ["overlapping_branches"]

# JSON's value types, with integers counted among the numbers (1 is both).
_ALL_TYPES = frozenset(["null", "boolean", "object", "array", "string", "number"])
# Deeper than this (a $ref cycle, an absurd nesting) the pair is taken to overlap.
_MAX_DEPTH = 32


def overlapping_branches(root: Any, branches: list[Any]) -> tuple[int, int] | None:
    """The first pair (i, j), i < j, of `oneOf` branches not proven mutually exclusive.

    Args:
        root: the whole schema (what `#` in a `$ref` names).
        branches: the `oneOf` list.

    Returns:
        None when every pair is exclusive (so `anyOf` accepts exactly what `oneOf` does).
    """
    for i in range(len(branches)):
        for j in range(i + 1, len(branches)):
            if not _exclusive(root, branches[i], branches[j], 0):
                return i, j
    return None


def _exclusive(root: Any, a: Any, b: Any, depth: int) -> bool:
    """True when no JSON value can satisfy both schemas (False: unknown or they overlap)."""
    if depth > _MAX_DEPTH:
        return False
    a, b = _resolve(root, a), _resolve(root, b)
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False  # `true`, an unresolved reference or not a schema: anything goes
    if _split_exclusive(root, a, b, depth) or _split_exclusive(root, b, a, depth):
        return True
    types_a, types_b = _types(a), _types(b)
    common = types_a & types_b
    if not common:
        return True
    values_a, values_b = _values(a), _values(b)
    if values_a is not None and values_b is not None and not values_a & values_b:
        return True
    return common == {"object"} and _discriminated(root, a, b, depth)


def _split_exclusive(root: Any, a: dict[str, Any], b: Any, depth: int) -> bool:
    """`a` is within a union of schemas each exclusive with `b`, or within an `allOf`
    member exclusive with it."""
    for key in ("anyOf", "oneOf"):
        members = a.get(key)
        if isinstance(members, list) and members and all(
                _exclusive(root, member, b, depth + 1) for member in members):
            return True
    members = a.get("allOf")
    return isinstance(members, list) and any(
        _exclusive(root, member, b, depth + 1) for member in members)


def _discriminated(root: Any, a: dict[str, Any], b: dict[str, Any], depth: int) -> bool:
    """Both require a property whose schemas are exclusive (only for object-only branches:
    `required` and `properties` say nothing about other types)."""
    props_a, props_b = a.get("properties"), b.get("properties")
    if not isinstance(props_a, dict) or not isinstance(props_b, dict):
        return False
    required = _required(a) & _required(b)
    return any(name in props_a and name in props_b
               and _exclusive(root, props_a[name], props_b[name], depth + 1)
               for name in sorted(required))


def _required(schema: dict[str, Any]) -> set[str]:
    names = schema.get("required")
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()


def _resolve(root: Any, schema: Any) -> Any:
    """`schema` with local `$ref`s followed (None where one cannot be); a schema that has
    keywords beside its `$ref` allows at most what the target allows, so the target stands in
    for it (sound for exclusivity)."""
    seen: set[str] = set()
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        ref = schema["$ref"]
        if ref in seen:
            return None
        seen.add(ref)
        schema = _pointer(root, ref)
    return schema


def _pointer(root: Any, ref: str) -> Any:
    if ref != "#" and not ref.startswith("#/"):
        return None  # a remote or anchor reference: not followed
    node = root
    for token in ref[2:].split("/") if ref != "#" else []:
        key = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _types(schema: dict[str, Any]) -> frozenset[str]:
    """The JSON types `schema` can accept (`type`, `const` and `enum` together)."""
    types = _ALL_TYPES
    declared = schema.get("type")
    if isinstance(declared, str):
        declared = [declared]
    if isinstance(declared, list):
        types &= frozenset("number" if t == "integer" else t for t in declared
                           if isinstance(t, str))
    if "const" in schema:
        types &= {_type_of(schema["const"])}
    enum = schema.get("enum")
    if isinstance(enum, list):
        types &= {_type_of(v) for v in enum}
    return types


def _values(schema: dict[str, Any]) -> set[Any] | None:
    """The (canonical forms of the) only values `schema` accepts, or None if not finite."""
    values: set[Any] | None = None
    if "const" in schema:
        values = {_canonical(schema["const"])}
    enum = schema.get("enum")
    if isinstance(enum, list):
        listed = {_canonical(v) for v in enum}
        values = listed if values is None else values & listed
    return values


def _canonical(value: Any) -> Any:
    """A hashable form equal for values JSON Schema calls equal (numbers by value, booleans
    apart from numbers, objects regardless of key order)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (_type_of(value), value)
    if isinstance(value, int | float):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return ("number", value)
    if isinstance(value, list):
        return ("array", tuple(_canonical(v) for v in value))
    if isinstance(value, dict):
        return ("object", tuple(sorted((str(k), _canonical(v)) for k, v in value.items())))
    return ("other", repr(value))
