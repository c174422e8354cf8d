"""What llguidance's greedy lexer needs to know about pieces of a Lark grammar, for the
structural-tag conversion (`guidance_structural_tag.py`, its only user).

llguidance lexes greedily: a lexeme ends only where the next byte cannot extend it. A `Piece`
is a converted format, either a terminal expression (`regular`: one lexeme, a regular
expression with llguidance's `&` and `~`, exact by construction) or the name of a rule; with
it travel the characters a match can start with (`first`), whether it can be empty, and the
characters that can continue a complete match (`ext`; empty when the piece is prefix-free).
`unsafe_boundary` and `distinct` use them to prove that greedy lexing cuts a sequence, or
picks an alternative, exactly where the format does; the helpers build Lark text.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

ANY = "/(?s:.*)/"
SOME = "/(?s:.+)/"
JSON_FIRST = frozenset('{["-0123456789tfn')  # JSON values start so, never with whitespace
NUMBER_TAIL = frozenset("0123456789.eE+-")
# Characters a piece can start with, or continue a complete match with; None: any.
Chars = frozenset[str] | None


@dataclasses.dataclass(frozen=True)
class Piece:
    """A converted format: a terminal expression (`regular`) or a rule name, with what the
    greedy-lexing checks need to know about the text it matches."""

    expr: str
    regular: bool
    first: Chars        # characters a match can start with
    nullable: bool      # matches the empty string
    ext: Chars          # characters that can continue a complete match (empty: prefix-free)
    lead: str = ""      # text every match starts with
    const: str | None = None  # the one string it matches, if so

    @staticmethod
    def of(expr: str, regular: bool, info: Info, const: str | None = None) -> Piece:
        return Piece(expr, regular, info.first, info.nullable, info.ext, info.lead, const)


class Info(NamedTuple):
    """A piece's description, before it has an expression."""

    first: Chars
    nullable: bool
    ext: Chars
    lead: str = ""


def union(*sets: Chars) -> Chars:
    out: set[str] = set()
    for s in sets:
        if s is None:
            return None
        out |= s
    return frozenset(out)


def meets(ext: Chars, first: Chars) -> bool:
    """Whether a complete match of one piece can be extended by the next piece's start."""
    if (ext is not None and not ext) or (first is not None and not first):
        return False
    return ext is None or first is None or bool(ext & first)


def common_prefix(strings: Sequence[str]) -> str:
    if not strings:
        return ""
    lo, hi = min(strings), max(strings)
    n = 0
    while n < min(len(lo), len(hi)) and lo[n] == hi[n]:
        n += 1
    return lo[:n]


def lit(text: str) -> str:
    return json.dumps(text)  # ASCII escapes (llguidance refuses raw controls and DEL)


def alt(strings: Iterable[str]) -> str:
    return "(" + " | ".join(lit(s) for s in strings) + ")"


def overlap(strings: Sequence[str]) -> tuple[str, str] | None:
    """A pair where one string occurs inside the other, or a proper suffix of one starts the
    other (itself included): the cases where "first occurrence" and "does not contain" differ,
    or one end can run into another."""
    for a in strings:
        for b in strings:
            if a != b and a in b:
                return a, b
            if any(b.startswith(a[k:]) for k in range(1, len(a))):
                return a, b
    return None


def group(expr: str) -> str:
    return expr if expr.isidentifier() else f"({expr})"


def may_be_number(schema: Any, root: Any, seen: frozenset[str] = frozenset()) -> bool:
    """False only when a JSON value of `schema` is surely not a number (a number is the one
    JSON value that can be continued and still be one: `1` then `2`)."""
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        return True
    numeric = ("number", "integer")
    if "const" in schema:
        return _is_number(schema["const"])
    if isinstance(schema.get("enum"), list):
        return any(_is_number(v) for v in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, str) and kind not in numeric:
        return False
    if isinstance(kind, list) and not any(k in numeric for k in kind):
        return False
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and not any(may_be_number(b, root, seen)
                                                  for b in branches):
            return False
    branches = schema.get("allOf")
    if isinstance(branches, list) and not all(may_be_number(b, root, seen) for b in branches):
        return False
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/") and ref not in seen:
        target: Any = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        if target is not None and not may_be_number(target, root, seen | {ref}):
            return False
    return True


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def const(text: str) -> Piece:
    return Piece(lit(text), True, frozenset(text[:1]), not text, frozenset(), text, text)


def ends(strings: Sequence[str]) -> Piece:
    """The alternation of a tag's ends (none: the empty string)."""
    pieces = [const(e) for e in strings]
    if len(pieces) <= 1:
        return pieces[0] if pieces else const("")
    closed = distinct(pieces)
    return Piece(alt(strings), True, union(*(p.first for p in pieces)), "" in strings,
                 frozenset() if closed else None, common_prefix(strings))


def concat(a: Piece, b: Piece) -> Piece:
    """Two regular pieces as one terminal."""
    if a.const is not None and b.const is not None:
        return const(a.const + b.const)
    info = seq_info([a, b])
    if unsafe_boundary([a, b]) is not None:  # still exact as a regex, but not prefix-free
        info = info._replace(ext=None)
    return Piece.of(f"{group(a.expr)} {group(b.expr)}", True, info)


def seq_info(parts: Sequence[Piece]) -> Info:
    first: Chars = frozenset()
    for p in parts:
        first = union(first, p.first)
        if not p.nullable:
            break
    ext: Chars = frozenset()
    for p in reversed(parts):
        ext = union(ext, p.ext)
        if not p.nullable:
            break
        ext = union(ext, p.first)
    lead = ""
    for p in parts:
        if p.const is None:
            lead += p.lead
            break
        lead += p.const
    return Info(first, all(p.nullable for p in parts), ext, lead)


def unsafe_boundary(parts: Sequence[Piece]) -> str | None:
    """Why greedy lexing could end a piece of a sequence elsewhere than the format does."""
    for i, p in enumerate(parts):
        for q in parts[i + 1:]:
            if meets(p.ext, q.first):
                what = ("a JSON number" if p.ext == NUMBER_TAIL else
                        "a piece that can go on" if p.ext is None else
                        f"a piece that can go on with {sorted(p.ext)}")
                return (f"{what} followed by a piece that can start the same way cannot be "
                        "enforced exactly by llguidance's greedy lexer (it would take the "
                        "longest match)")
            if not q.nullable:
                break
    return None


def distinct(parts: Sequence[Piece]) -> bool:
    """No two alternatives can start alike: they start with different characters, or with
    literal texts neither of which starts the other."""
    for i, p in enumerate(parts):
        for q in parts[i + 1:]:
            disjoint = (p.first is not None and q.first is not None and not p.nullable
                        and not q.nullable and not p.first & q.first)
            leads = bool(p.lead and q.lead and not p.lead.startswith(q.lead)
                         and not q.lead.startswith(p.lead))
            if not (disjoint or leads):
                return False
    return True
