"""Strict type checks for wire structs built in Python, as strict as the wire's decoder.

msgspec checks every field's type when it *decodes* a struct, but not when Python code
*constructs* one: `SamplingParams(max_tokens=100.0)` builds, is then refused by the engine
core's strict decoder, and a request that was never admitted waits forever. The public entry
points (`SamplingParams`, the input processor behind `LLM.generate`, `AsyncLLM.generate` and
`add_request`) run `check_fields` so such a value fails at once with a `TypeError` naming the
field. The rules are msgspec's strict ones: an `int` field takes an int but not a bool, a
`float` field an int or a float but not a bool, a `str` field only a str, a list field a list
(or tuple) of the item type, a dict field a dict of the key and value types, an `IntEnum`
field one of its members (a valid int value becomes the member). Checkers are built once per
struct class from `msgspec.inspect` and cached.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import inspect as mi

__all__ = ["check_fields", "check_value"]

# A checker returns the (possibly normalized) value or raises TypeError naming `path`.
_Checker = Callable[[Any, str], Any]

_CHECKERS: dict[type, list[tuple[str, Any, _Checker]]] = {}
_BY_ANNOTATION: dict[Any, _Checker] = {}


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(path: str, value: Any, expected: str) -> TypeError:
    return TypeError(f"{path}: expected {expected}, got {type(value).__name__} {_describe(value)}")


def _int(value: Any, path: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(path, value, "an int")
    return value


def _float(value: Any, path: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, value, "a float")
    return value


def _bool(value: Any, path: str) -> Any:
    if not isinstance(value, bool):
        raise _fail(path, value, "a bool")
    return value


def _str(value: Any, path: str) -> Any:
    if not isinstance(value, str):
        raise _fail(path, value, "a str")
    return value


def _none(value: Any, path: str) -> Any:
    if value is not None:
        raise _fail(path, value, "None")
    return value


def _any(value: Any, path: str) -> Any:
    return value


def _enum(cls: type[enum.Enum]) -> _Checker:
    values = {member.value: member for member in cls}

    def check(value: Any, path: str) -> Any:
        if isinstance(value, cls):
            return value
        if not isinstance(value, bool) and isinstance(value, (int, str)) and value in values:
            return values[value]
        raise _fail(path, value, f"a {cls.__name__} (one of {sorted(values)})")

    return check


def _list(item: _Checker) -> _Checker:
    def check(value: Any, path: str) -> Any:
        if not isinstance(value, (list, tuple)):
            raise _fail(path, value, "a list")
        for i, element in enumerate(value):
            item(element, f"{path}[{i}]")
        return value

    return check


def _dict(key: _Checker, val: _Checker) -> _Checker:
    def check(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise _fail(path, value, "a dict")
        for k, v in value.items():
            key(k, f"{path} key")
            val(v, f"{path}[{k!r}]")
        return value

    return check


def _struct(cls: type) -> _Checker:
    def check(value: Any, path: str) -> Any:
        if not isinstance(value, cls):
            raise _fail(path, value, f"a {cls.__name__}")
        return value  # its own construction checked its fields

    return check


def _union(options: list[tuple[mi.Type, _Checker]]) -> _Checker:
    checkers = [checker for _, checker in options]
    expected = " or ".join(_name(t) for t, _ in options)

    def check(value: Any, path: str) -> Any:
        deeper: TypeError | None = None
        for checker in checkers:
            try:
                return checker(value, path)
            except TypeError as exc:
                # The value had this option's shape but an element did not fit: say which.
                if not str(exc).startswith(f"{path}:"):
                    deeper = exc
        raise deeper or _fail(path, value, expected)

    return check


def _name(t: mi.Type) -> str:
    names = {mi.IntType: "an int", mi.FloatType: "a float", mi.BoolType: "a bool",
             mi.StrType: "a str", mi.NoneType: "None", mi.ListType: "a list",
             mi.DictType: "a dict"}
    return names.get(type(t), type(t).__name__.removesuffix("Type"))


_SCALARS: dict[type, _Checker] = {
    mi.IntType: _int, mi.FloatType: _float, mi.BoolType: _bool, mi.StrType: _str,
    mi.NoneType: _none, mi.AnyType: _any,
}


def _checker_for(t: mi.Type) -> _Checker:
    scalar = _SCALARS.get(type(t))
    if scalar is not None:
        return scalar
    if isinstance(t, mi.UnionType):
        return _union([(option, _checker_for(option)) for option in t.types])
    if isinstance(t, (mi.ListType, mi.TupleType, mi.VarTupleType)):
        item = t.item_type if not isinstance(t, mi.TupleType) else mi.AnyType()
        return _list(_checker_for(item))
    if isinstance(t, mi.DictType):
        return _dict(_checker_for(t.key_type), _checker_for(t.value_type))
    if isinstance(t, mi.EnumType):
        return _enum(t.cls)
    if isinstance(t, mi.StructType):
        return _struct(t.cls)
    # A wire struct gained a field type this module has no rule for: add one here.
    raise TypeError(f"typecheck: no strict check for field type {t!r}")


def _checkers(cls: type) -> list[tuple[str, Any, _Checker]]:
    checkers = _CHECKERS.get(cls)
    if checkers is None:
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        # A field still holding its (immutable) default needs no check: most of them do.
        checkers = [(field.name, field.default, _checker_for(field.type))
                    for field in info.fields]
        _CHECKERS[cls] = checkers
    return checkers


def check_fields(obj: msgspec.Struct, prefix: str | None = None) -> None:
    """Check every field of `obj` against its annotation; normalize enum fields given as
    their int value.

    Args:
        obj: a struct constructed in Python.
        prefix: the name to report fields under (default: the struct's class name).

    Raises:
        TypeError: a field holds a value of the wrong type; the message names the field
            (`SamplingParams.max_tokens: expected an int, got float 100.0`).
    """
    cls = type(obj)
    name = cls.__name__ if prefix is None else prefix
    for field, default, checker in _checkers(cls):
        value = getattr(obj, field)
        if value is default:
            continue
        checked = checker(value, f"{name}.{field}")
        if checked is not value:
            setattr(obj, field, checked)


def check_value(value: Any, annotation: Any, path: str) -> Any:
    """Check one value against a type annotation (the same rules as `check_fields`).

    Returns:
        The value (an enum member when given as its int value).

    Raises:
        TypeError: naming `path`.
    """
    checker = _BY_ANNOTATION.get(annotation)
    if checker is None:
        checker = _BY_ANNOTATION[annotation] = _checker_for(mi.type_info(annotation))
    return checker(value, path)
