"""Structural tags as llguidance grammars, for the guidance backend (`guidance_backend.py`
calls `structural_tag_grammar`; nothing else does).

Two forms arrive as JSON text in `StructuredOutputsParams.structural_tag`:

- the legacy `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`, compiled by
  `llguidance.StructTag` (vLLM's guidance backend does the same);
- the current `{"type": "structural_tag", "format": {...}}`, xgrammar's, compiled here into one
  Lark grammar that matches what xgrammar (0.2.9) matches: `const_string`, `regex`, `any_text`,
  `json_schema`, `sequence`, `or`, `optional`, `star`, `plus`, `repeat`, `tag`,
  `triggered_tags`, `tags_with_separator` and `dispatch`.

Exactness. llguidance lexes greedily (a lexeme ends only where the next byte cannot extend
it), so `/a+/ "ab"` refuses `aaab`, which `sequence(regex a+, const_string "ab")` accepts.
Every piece built only from text formats (all but `json_schema`) therefore becomes one
terminal, a regular expression (with llguidance's `&` and `~`) that means exactly what the
format means: `any_text` and the free text of `triggered_tags` exclude their `excludes` and the
ends of the nearest enclosing `tag`; `triggered_tags` and `dispatch` switch at the first
trigger in the text; a `regex` is read as xgrammar reads it (`xgrammar_regex.py`). A JSON
schema is a sub-grammar with lexemes of its own; wherever one meets a neighbour, the
conversion proves (`guidance_lexing.py`) that greedy lexing cuts where the format does, and
refuses the tag otherwise (a JSON number followed by a digit, alternatives that start alike).
The JSON follows this backend's `json` rules: the schema as written (additional properties
allowed unless it says otherwise, where xgrammar's structural tags forbid them), unknown
keywords refused, flexible whitespace between tokens and none around the value.

Refused, naming the type (a 400): `grammar` (llguidance lexes a grammar's own terminals
greedily, so some grammars match fewer strings than they say); the token-level formats
(`token`, `exclude_token`, `any_tokens`, `token_triggered_tags`, `token_dispatch`, a `tag` with
a token begin or end: llguidance matches a token id as a lexeme beside text lexemes, which
does not keep their meaning); `json_schema` with a `style` other than `json` (and the
deprecated `qwen_xml_parameter`), `any_order`, `max_whitespace_cnt` or `excludes`;
`any_text.max_tokens` (llguidance's token budgets turn rollback off, which speculative
decoding needs).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import llguidance

from ringserve.engine.structured import guidance_lexing as lx
from ringserve.engine.structured.xgrammar_regex import rust_regex

__all__ = ["structural_tag_grammar"]

_FIELD = "structured_outputs.structural_tag"
_TOKEN_LEVEL = ("token", "exclude_token", "any_tokens", "token_triggered_tags", "token_dispatch")
Ends = Sequence[str]  # the ends of the tag a format is in
_WHY_TOKENS = ("llguidance matches a token id as a lexeme beside text lexemes, which does not "
               "keep the format's meaning")
_REFUSED = {
    "grammar": "llguidance lexes a grammar's terminals greedily, so a grammar can match fewer "
               "strings than it says: `\"a\" \"bc\" | \"ab\" \"d\"` would refuse abc",
    "qwen_xml_parameter": "its XML parameter syntax is xgrammar's",
}


def structural_tag_grammar(spec: str) -> str:
    """The llguidance grammar of a structural tag (either form).

    Raises:
        ValueError: a malformed tag, or a format the guidance backend cannot enforce exactly;
            the message starts `structured_outputs.structural_tag:` and names the format.
    """
    try:
        tag = json.loads(spec)
    except ValueError as exc:
        raise ValueError(f"{_FIELD}: invalid structural tag: not JSON: {exc}") from None
    if not isinstance(tag, dict):
        raise ValueError(f"{_FIELD}: invalid structural tag: expected an object")
    if "structures" in tag:
        return _legacy_grammar(tag)
    if tag.get("type", "structural_tag") != "structural_tag" or "format" not in tag:
        raise ValueError(f'{_FIELD}: invalid structural tag: expected {{"type": '
                         '"structural_tag", "format": {...}} or {"structures": [...], '
                         '"triggers": [...]}')
    try:
        return _Converter().grammar(tag["format"])
    except RecursionError:
        raise ValueError(f"{_FIELD}: invalid structural tag: formats nested too deeply"
                         ) from None


def _legacy_grammar(tag: dict[str, Any]) -> str:
    try:
        triggers: list[str] = tag["triggers"]
        tags = []
        for s in tag["structures"]:
            trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
            if trigger is None:
                raise ValueError(f"no trigger in {triggers} starts {s['begin']!r}")
            schema = s["schema"]
            tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"],
                                             grammar=schema if isinstance(schema, dict)
                                             else json.dumps(schema), end=s["end"]))
        if not tags:
            raise ValueError("no structures")
        return llguidance.StructTag.to_grammar(tags)
    except (ValueError, TypeError, KeyError, AssertionError) as exc:
        raise ValueError(f"{_FIELD}: invalid structural tag: {exc}") from None


# -- the converter -----------------------------------------------------------------------------

class _Inexact(ValueError):
    """A composition greedy lexing would cut differently from the format."""


class _Converter:
    """One structural tag's conversion: the Lark rules and terminals it defines."""

    def __init__(self) -> None:
        self._defs: list[str] = []

    def grammar(self, fmt: Any) -> str:
        try:
            root = self._format(fmt, "format", ())
        except _Inexact as exc:
            raise ValueError(f"{_FIELD}: {exc}; use the xgrammar backend") from None
        return llguidance.LLMatcher.grammar_from_lark(
            "\n".join([f"start: {self._ref(root)}", *self._defs]))

    # names

    def _ref(self, piece: lx.Piece) -> str:
        """A name for `piece` inside a rule (a regular piece becomes a terminal)."""
        if not piece.regular:
            return piece.expr
        if piece.const is not None:
            return lx.lit(piece.const)
        name = f"T{len(self._defs)}"
        self._defs.append(f"{name}: {piece.expr}")
        return name

    def _rule(self, body: str, info: lx.Info) -> lx.Piece:
        name = f"r{len(self._defs)}"
        self._defs.append(f"{name}: {body}")
        return lx.Piece.of(name, False, info)

    # combinators

    def _seq(self, parts: Sequence[lx.Piece], where: str) -> lx.Piece:
        parts = [p for p in parts if p.const != ""]
        if not parts:
            return lx.const("")
        if len(parts) == 1:
            return parts[0]
        merged: list[lx.Piece] = []  # runs of regular pieces become one terminal
        for p in parts:
            if p.regular and merged and merged[-1].regular:
                merged[-1] = lx.concat(merged[-1], p)
            else:
                merged.append(p)
        if len(merged) == 1:
            return merged[0]
        bad = lx.unsafe_boundary(merged)
        if bad is not None:
            raise _Inexact(f"{where}: {bad}")
        return self._rule(" ".join(self._ref(p) for p in merged), lx.seq_info(merged))

    def _or(self, parts: Sequence[lx.Piece], where: str, exclusive: bool = False) -> lx.Piece:
        """`exclusive`: the alternatives' first lexemes are known never to compete."""
        if len(parts) == 1:
            return parts[0]
        distinct = exclusive or lx.distinct(parts)
        info = lx.Info(lx.union(*(p.first for p in parts)), any(p.nullable for p in parts),
                       lx.union(*(p.ext for p in parts)) if distinct else None,
                       lx.common_prefix([p.lead for p in parts]))
        if all(p.regular for p in parts):
            return lx.Piece.of(" | ".join(lx.group(p.expr) for p in parts), True, info)
        if not distinct:
            raise _Inexact(f"{where}: alternatives that can start alike (one's first lexeme "
                           "can run into the other's) cannot be told apart by llguidance's "
                           "greedy lexer")
        return self._rule(" | ".join(self._ref(p) for p in parts), info)

    def _repeat(self, p: lx.Piece, lo: int, hi: int | None, where: str) -> lx.Piece:
        if hi == lo == 1:
            return p
        if hi == 0:
            return lx.const("")
        again = hi is None or hi > 1
        safe = not again or (not p.nullable and not lx.meets(p.ext, p.first))
        more = hi is None or hi > lo
        info = lx.Info(p.first, lo == 0 or p.nullable,
                       lx.union(p.ext, p.first if more else frozenset()) if safe else None,
                       p.lead if lo > 0 else "")
        bounds = ("?" if (lo, hi) == (0, 1) else "*" if (lo, hi) == (0, None)
                  else "+" if (lo, hi) == (1, None) else f"{{{lo},}}" if hi is None
                  else f"{{{lo},{hi}}}")
        if p.regular:
            const = p.const * lo if p.const is not None and lo == hi else None
            return lx.Piece.of(f"{lx.group(p.expr)}{bounds}", True, info, const)
        if not safe:
            raise _Inexact(f"{where}: a repeated piece whose end can run into its next "
                           "repetition cannot be enforced exactly by llguidance's greedy lexer")
        return self._rule(f"{p.expr}{bounds}", info)

    # formats

    def _format(self, fmt: Any, where: str, ends: Ends) -> lx.Piece:
        """`ends`: the nearest enclosing tag's ends, which xgrammar excludes from every
        any_text and triggered_tags free text below that tag."""
        kind = _kind(fmt, where)
        if kind in _TOKEN_LEVEL:
            raise _unsupported(where, kind, _WHY_TOKENS)
        if kind in _REFUSED:
            raise _unsupported(where, kind, _REFUSED[kind])
        handler = getattr(self, f"_f_{kind}", None)
        if handler is None:
            raise ValueError(f"{_FIELD}: invalid structural tag: {where}.type: got {kind!r}, "
                             f"allowed: {', '.join(_FORMATS)}")
        piece: lx.Piece = handler(fmt, where, ends)
        return piece

    def _content(self, fmt: dict[str, Any], where: str, ends: Ends) -> lx.Piece:
        return self._format(fmt.get("content"), f"{where}.content", ends)

    def _f_const_string(self, fmt: dict[str, Any], where: str, ends: Ends) -> lx.Piece:
        return lx.const(_str(fmt, "value", where))

    def _f_regex(self, fmt: dict[str, Any], where: str, ends: Ends) -> lx.Piece:
        try:
            pattern = rust_regex(_str(fmt, "pattern", where))
        except ValueError as exc:
            raise _invalid(where, str(exc)) from None
        return lx.Piece(f"/{pattern}/", True, None, True, None)

    def _f_any_text(self, fmt: dict[str, Any], where: str, ends: Ends) -> lx.Piece:
        if fmt.get("max_tokens") is not None:
            raise _unsupported(where, "any_text with max_tokens", "llguidance's token "
                               "budgets turn rollback off, which speculative decoding needs")
        excludes = [*_excludes(fmt, where), *(e for e in ends if e)]
        max_chars = fmt.get("max_chars")
        if max_chars is None:
            body = lx.ANY
        elif _is_count(max_chars):
            body = f"/(?s:.){{0,{max_chars}}}/"
        else:
            raise _invalid(where, f"max_chars: got {max_chars!r}, allowed: an integer >= 0")
        if excludes:
            body = f"{body} & ~({lx.ANY} {lx.alt(excludes)} {lx.ANY})"
        return lx.Piece(body, True, None, True, None)

    def _f_json_schema(self, fmt: dict[str, Any], where: str, ends: Ends) -> lx.Piece:
        schema = fmt.get("json_schema")
        if not isinstance(schema, dict | bool):
            raise _invalid(where, "json_schema: expected a JSON schema (an object or a boolean)")
        style = fmt.get("style", "json")
        if style != "json":
            raise _unsupported(where, f"json_schema with style {style!r}",
                               "its parameter syntax is xgrammar's")
        for key, default in (("any_order", False), ("max_whitespace_cnt", None),
                             ("excludes", [])):
            if fmt.get(key, default) != default:
                raise _unsupported(where, f"json_schema with {key}",
                                   "llguidance's JSON compiler has no such option")
        options = schema.get("x-guidance", {}) if isinstance(schema, dict) else None
        if isinstance(schema, dict) and isinstance(options, dict):  # strict, as `json` is
            schema = {**schema, "x-guidance": {**options, "lenient": False}}
        tail = lx.NUMBER_TAIL if lx.may_be_number(schema, schema) else frozenset()
        return self._rule(f"%json {json.dumps(schema)}", lx.Info(lx.JSON_FIRST, False, tail))

    def _f_sequence(self, fmt: dict[str, Any], where: str, ends: Ends) -> lx.Piece:
        return self._seq([self._format(e, f"{where}.elements[{i}]", ends)
                          for i, e in enumerate(_list(fmt, "elements", where))], where)

    def _f_or(self, fmt: dict[str, Any], where: str, ends: Ends) -> lx.Piece:
        return self._or([self._format(e, f"{where}.elements[{i}]", ends)
                         for i, e in enumerate(_list(fmt, "elements", where))], where)

    def _f_optional(self, fmt: dict[str, Any], where: str, ends: Ends) -> lx.Piece:
        return self._repeat(self._content(fmt, where, ends), 0, 1, where)

    def _f_star(self, fmt: dict[str, Any], where: str, ends: Ends) -> lx.Piece:
        return self._repeat(self._content(fmt, where, ends), 0, None, where)

    def _f_plus(self, fmt: dict[str, Any], where: str, ends: Ends) -> lx.Piece:
        return self._repeat(self._content(fmt, where, ends), 1, None, where)

    def _f_repeat(self, fmt: dict[str, Any], where: str, ends: Ends) -> lx.Piece:
        lo: Any = fmt.get("min")
        hi: Any = fmt.get("max")
        if not (_is_count(lo) and (hi == -1 or (_is_count(hi) and hi >= lo))):
            raise _invalid(where, f"min / max: got {lo!r} / {hi!r}, allowed: 0 <= min <= max, "
                           "or max -1 (no limit)")
        return self._repeat(self._content(fmt, where, ends), lo, None if hi == -1 else hi,
                            where)

    def _f_tag(self, fmt: dict[str, Any], where: str, outer: Ends, trim: int = 0) -> lx.Piece:
        """`begin content end`; `trim` drops that many characters of `begin` (its trigger,
        already matched). The content sees this tag's ends, not the `outer` ones."""
        begin, ends = _tag_ends(fmt, where)
        content: Any = fmt.get("content")
        kind = _kind(content, f"{where}.content")
        stops = [e for e in ends if e]
        if not stops and _unlimited(content) and not _excluded(content):
            raise _invalid(where, "end: an unlimited content needs a non-empty end (or "
                           "excludes)")
        head = lx.const(begin[trim:])
        at = f"{where}.content"
        if kind == "any_text":  # closed by the first end, which it cannot hold
            tail = lx.concat(self._f_any_text(content, at, ends), lx.ends(ends))
            closed = "" not in ends and lx.overlap(stops) is None
            tail = dataclasses.replace(tail, ext=frozenset() if closed else None)
        elif kind == "triggered_tags":
            tail = self._f_triggered_tags(content, at, ends, close=True)
        elif kind == "dispatch" and stops and set(stops) <= set(_excludes(content, at)):
            # Its free text cannot hold the ends already: they close it as they close
            # triggered_tags (the same language, but prefix-free).
            tail = self._f_dispatch(content, at, ends, close=True)
        else:
            return self._seq([head, self._format(content, at, ends), lx.ends(ends)], where)
        return self._seq([head, tail], where)

    def _f_triggered_tags(self, fmt: dict[str, Any], where: str, ends: Ends,
                          close: bool = False) -> lx.Piece:
        """`close`: it is its tag's whole content, so that tag's ends follow it."""
        triggers = [_nonempty(t, f"{where}.triggers") for t in _list(fmt, "triggers", where)]
        groups: dict[str, list[lx.Piece]] = {t: [] for t in triggers}
        at_least_one = _flag(fmt, "at_least_one", where)
        tags: list[lx.Piece] = []  # whole tags: at_least_one starts with one
        for i, tag in enumerate(_list(fmt, "tags", where)):
            at = f"{where}.tags[{i}]"
            if _kind(tag, at) != "tag":
                raise _invalid(at, f"expected a tag, got {tag.get('type')!r}")
            begin, _ = _tag_ends(tag, at)
            matching = [t for t in triggers if begin.startswith(t)]
            if len(matching) != 1:
                raise _invalid(at, f"begin {begin!r} must start with exactly one trigger of "
                               f"{triggers}")
            groups[matching[0]].append(self._f_tag(tag, at, ends, trim=len(matching[0])))
            if at_least_one:
                tags.append(self._f_tag(tag, at, ends))
        stops = [*_excludes(fmt, where), *(e for e in ends if e)]
        return self._dispatch(groups, tags, stops, ends if close else (), where,
                              at_least_one=at_least_one,
                              stop_after_first=_flag(fmt, "stop_after_first", where))

    def _f_dispatch(self, fmt: dict[str, Any], where: str, ends: Ends,
                    close: bool = False) -> lx.Piece:
        """`close`: as for triggered_tags (only when its excludes hold the ends)."""
        groups: dict[str, list[lx.Piece]] = {}
        for i, rule in enumerate(_list(fmt, "rules", where)):
            at = f"{where}.rules[{i}]"
            if not (isinstance(rule, list) and len(rule) == 2):
                raise _invalid(at, "expected [pattern, format]")
            pattern = _nonempty(rule[0], at)
            groups.setdefault(pattern, []).append(self._format(rule[1], f"{at}[1]", ends))
        loop = _flag(fmt, "loop", where, default=True)
        return self._dispatch(groups, [], _excludes(fmt, where), ends if close else (), where,
                              at_least_one=False, stop_after_first=not loop)

    def _f_tags_with_separator(self, fmt: dict[str, Any], where: str, ends: Ends) -> lx.Piece:
        separator = _str(fmt, "separator", where)
        tags = []
        for i, tag in enumerate(_list(fmt, "tags", where)):
            if _kind(tag, f"{where}.tags[{i}]") != "tag":
                raise _invalid(f"{where}.tags[{i}]", f"expected a tag, got {tag.get('type')!r}")
            tags.append(self._f_tag(tag, f"{where}.tags[{i}]", ends))
        one = self._or(tags, where)
        body = one
        if not _flag(fmt, "stop_after_first", where):
            again = self._seq([lx.const(separator), one], where)
            body = self._seq([one, self._repeat(again, 0, None, where)], where)
        return body if _flag(fmt, "at_least_one", where) else self._repeat(body, 0, 1, where)

    def _dispatch(self, groups: dict[str, list[lx.Piece]], tags: list[lx.Piece],
                  stops: list[str], close: Ends, where: str, *, at_least_one: bool,
                  stop_after_first: bool) -> lx.Piece:
        """Free text switching at the first trigger to what follows it (`groups`: trigger ->
        the alternatives after it), as triggered_tags and dispatch mean it: the free text
        (with the trigger) holds none of `stops`; `tags` are the whole tags (for
        at_least_one); `close` the ends of the tag it fills, which close it (and are among
        `stops`)."""
        triggers = list(groups)
        free = f"~({lx.ANY} {lx.alt(stops)} {lx.ANY})" if stops else ""
        # Free text then a trigger, the first in the text: prefix-free, and two of these never
        # compete (the one whose trigger comes first ends first).
        items = []
        for trigger, rests in groups.items():
            expr = f"({lx.ANY} {lx.lit(trigger)}) & ~({lx.ANY} {lx.alt(triggers)} {lx.SOME})"
            head = lx.Piece(f"{expr} & {free}" if free else expr, True, None, False, frozenset())
            after = self._or(rests, where)
            items.append(self._seq([head, after, lx.ends(close)] if stop_after_first
                                   else [head, after], where))
        final = lx.Piece(f"{lx.ANY} & ~({lx.ANY} {lx.alt([*triggers, *stops])} {lx.ANY})",
                         True, None, True, None)
        if close:
            overlap = lx.overlap([*triggers, *(e for e in close if e)])
            final = dataclasses.replace(lx.concat(final, lx.ends(close)), ext=frozenset()
                                        if "" not in close and overlap is None else None)
            if overlap is not None and not all(p.regular for p in items):
                raise _Inexact(f"{where}: the triggers and ends {overlap[0]!r} and "
                               f"{overlap[1]!r} overlap, so llguidance's greedy lexer "
                               "could not tell where the free text ends")
        if at_least_one and stop_after_first:
            return self._seq([self._or(tags, where), lx.ends(close)], where)
        if stop_after_first:
            return self._or([final, *items], where, exclusive=True)
        dispatched = self._or(items, where, exclusive=True)
        parts = [dispatched, final]
        if at_least_one:
            parts.insert(0, self._or(tags, where))
        if all(p.regular for p in parts):
            return self._seq([*parts[:-2], self._repeat(dispatched, 0, None, where), final],
                             where)
        # No lexeme runs across these boundaries when the dispatched parts (and the first
        # tag) end prefix-free: then the trigger heads and the free text compete from a fresh
        # lexeme, and only until the first trigger, which the free text cannot hold.
        if any(p.ext != frozenset() for p in parts[:-1]):
            raise _Inexact(f"{where}: a tag or dispatched format that can go on after a "
                           "complete match, followed by free text, cannot be enforced exactly "
                           "by llguidance's greedy lexer")
        parts[-2] = self._repeat(dispatched, 0, None, where)
        return self._rule(" ".join(self._ref(p) for p in parts), lx.seq_info(parts))


_FORMATS = ("const_string", "regex", "any_text", "json_schema", "sequence", "or",
            "optional", "star", "plus", "repeat", "tag", "triggered_tags",
            "tags_with_separator", "dispatch")


# -- field access ------------------------------------------------------------------------------

def _invalid(where: str, what: str) -> ValueError:
    return ValueError(f"{_FIELD}: invalid structural tag: {where}: {what}")


def _unsupported(where: str, kind: str, why: str) -> ValueError:
    return ValueError(f"{_FIELD}: {where}: {kind} is not supported by the guidance backend "
                      f"({why}); use the xgrammar backend")


def _kind(fmt: Any, where: str) -> str:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise _invalid(where, 'expected a format object with a "type"')
    kind: str = fmt["type"]
    return kind


def _str(fmt: dict[str, Any], key: str, where: str) -> str:
    value = fmt.get(key)
    if not isinstance(value, str):
        raise _invalid(where, f"{key}: expected a string")
    return value


def _nonempty(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise _invalid(where, "expected a non-empty string")
    return value


def _list(fmt: dict[str, Any], key: str, where: str) -> list[Any]:
    value = fmt.get(key)
    if not isinstance(value, list) or not value:
        raise _invalid(where, f"{key}: expected a non-empty list")
    return value


def _flag(fmt: dict[str, Any], key: str, where: str, default: bool = False) -> bool:
    value = fmt.get(key, default)
    if not isinstance(value, bool):
        raise _invalid(where, f"{key}: expected true or false")
    return value


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _excludes(fmt: dict[str, Any], where: str) -> list[str]:
    value = fmt.get("excludes", [])
    if not isinstance(value, list):
        raise _invalid(where, "excludes: expected a list of strings")
    return [_nonempty(x, f"{where}.excludes") for x in value]


def _unlimited(fmt: Any) -> bool:
    """xgrammar's test for a content that needs its tag's end to stop."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("any_text", "triggered_tags", "token_triggered_tags", "dispatch",
                "token_dispatch", "any_tokens", "tags_with_separator", "star", "plus"):
        return True
    if kind in ("sequence", "or"):
        elements = fmt.get("elements")
        return isinstance(elements, list) and any(_unlimited(e) and not _excluded(e)
                                                  for e in elements)
    if kind == "optional":
        return _unlimited(fmt.get("content"))
    if kind == "repeat":
        return fmt.get("max") == -1 or (fmt.get("max") != 0 and _unlimited(fmt.get("content")))
    return False


def _excluded(fmt: Any) -> bool:
    return isinstance(fmt, dict) and bool(fmt.get("excludes") or fmt.get("exclude_tokens"))


def _tag_ends(fmt: dict[str, Any], where: str) -> tuple[str, list[str]]:
    begin, end = fmt.get("begin"), fmt.get("end")
    if isinstance(begin, dict) or isinstance(end, dict):
        raise _unsupported(where, "a tag with a token begin or end", _WHY_TOKENS)
    if not isinstance(begin, str):
        raise _invalid(where, "begin: expected a string")
    ends = [end] if isinstance(end, str) else end
    if not (isinstance(ends, list) and ends and all(isinstance(e, str) for e in ends)):
        raise _invalid(where, "end: expected a string or a non-empty list of strings")
    return begin, ends
