"""xgrammar's regex dialect rewritten in llguidance's (Rust `regex`) syntax, so that a
structural tag's `regex` format means under the guidance backend what it means under xgrammar
(`guidance_structural_tag.py` is the only user).

xgrammar reads a pattern as JavaScript does, with its own quirks (as of 0.2.9): `.` matches
any character, newline included; `\\d`, `\\w` are ASCII and `\\s` is JavaScript's whitespace
(Rust's are Unicode, and Rust's `\\s` differs by U+0085 and U+FEFF); `^` and `$` are ignored
wherever they stand; a named group is a plain group; `\\x` takes every hex digit that follows;
an unknown escape is the character itself; a class whose text starts with `^`, escaped or not,
is negated; inside a class, a `-` after a class escape, or escaped, is a literal. What xgrammar refuses (lookarounds, group flags, backreferences, `\\p`, `\\b` outside
a class, two quantifiers in a row) is refused here. Every literal is written as `\\x{...}`, so
the result holds no `/` and no raw control character (it goes inside Lark's `/.../`).
"""

from __future__ import annotations

__all__ = ["rust_regex"]

_MAX = 0x10FFFF
# xgrammar's escape classes (JavaScript's), as inclusive codepoint ranges.
_CLASSES = {
    "d": ((0x30, 0x39),),
    "w": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
    "s": ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
          (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
          (0xFEFF, 0xFEFF)),
}
_C_ESCAPES = {"'": 0x27, '"': 0x22, "?": 0x3F, "\\": 0x5C, "/": 0x2F, "a": 0x07, "b": 0x08,
              "f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B, "0": 0x00, "e": 0x1B}
_HEX = "0123456789abcdefABCDEF"
Ranges = tuple[tuple[int, int], ...]


def rust_regex(pattern: str) -> str:
    """`pattern` (xgrammar's dialect) in Rust `regex` syntax, matching the same strings.

    Raises:
        ValueError: a pattern xgrammar refuses too (the message says why and where).
    """
    return _Reader(pattern).convert()


def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in sorted(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = max(start, hi + 1)
    if start <= _MAX:
        out.append((start, _MAX))
    return tuple(out)


def _char(cp: int) -> str:
    ch = chr(cp)
    return ch if ch.isascii() and ch.isalnum() else f"\\x{{{cp:X}}}"


def _items(ranges: Ranges) -> str:
    return "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in ranges)


class _Reader:
    def __init__(self, pattern: str) -> None:
        self.text = pattern
        self.i = 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"regex {self.text!r} at {self.i + 1}: {what}")

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.text[j] if j < len(self.text) else ""

    def convert(self) -> str:
        out: list[str] = []
        depth = 0
        while self.i < len(self.text):
            ch = self.text[self.i]
            if ch in "^$":  # ignored by xgrammar, wherever they stand
                self.i += 1
            elif ch == "[":
                out.append(self.char_class())
            elif ch == "(":
                self.i += 1
                depth += 1
                if self.peek() == "?":
                    self.group_modifier()
                out.append("(?:")
            elif ch == ")":
                if depth == 0:
                    raise self.error("unmatched ')'")
                depth -= 1
                self.i += 1
                out.append(")")
            elif ch in "*+?{":
                out.append(self.quantifier())
            elif ch == "|":
                self.i += 1
                out.append("|")
            elif ch == "\\":
                out.append(self.escape())
            elif ch == ".":
                self.i += 1
                out.append("(?s:.)")
            else:
                self.i += 1
                out.append(_char(ord(ch)))
        if depth:
            raise self.error("the parenthesis is not closed")
        return "".join(out)

    def group_modifier(self) -> None:
        self.i += 1  # the '?'
        ch = self.peek()
        if ch == ":":
            self.i += 1
        elif ch in "=!" or (ch == "<" and self.peek(1) in ("=", "!")):
            raise self.error("lookarounds are not supported")
        elif ch == "<":
            self.i += 1
            while self.peek().isascii() and self.peek().isalpha():
                self.i += 1
            if self.peek() != ">":
                raise self.error("invalid named group")
            self.i += 1
        else:
            raise self.error("group flags are not supported")

    def quantifier(self) -> str:
        ch = self.text[self.i]
        self.i += 1
        if ch == "{":
            start = self.i
            while self.peek().isdigit():
                self.i += 1
            if self.i == start or self.peek() not in (",", "}"):
                raise self.error("invalid repetition count")
            if self.peek() == ",":
                self.i += 1
                while self.peek().isdigit():
                    self.i += 1
            if self.peek() != "}":
                raise self.error("invalid repetition count")
            self.i += 1
            ch = "{" + self.text[start:self.i]
        if self.peek() == "?":  # non-greedy: the same strings
            self.i += 1
        if self.peek() and self.peek() in "{*+?":
            raise self.error("two consecutive repetition modifiers")
        return ch

    def escape(self) -> str:
        code = self.peek(1)
        if not code:
            raise self.error("the escape sequence is not finished")
        if code.lower() in _CLASSES:
            self.i += 2
            return f"[{'^' if code.isupper() else ''}{_items(_CLASSES[code.lower()])}]"
        if code in "123456789k":
            raise self.error("backreferences are not supported")
        if code in "pP":
            raise self.error("Unicode property classes are not supported")
        if code in "bB":
            raise self.error("word boundaries are not supported")
        return _char(self.char_escape())

    def char_escape(self) -> int:
        """The codepoint of the escape at `i` (not a class escape), as xgrammar reads it."""
        code = self.peek(1)
        left = len(self.text) - self.i
        if left < 2 or left < {"u": 5, "x": 4, "c": 3}.get(code, 2):
            raise self.error("the escape sequence is not finished")
        if code in "^$.*+?\\()[]{}|/-" or code in _C_ESCAPES:
            self.i += 2
            return ord(code) if code not in _C_ESCAPES else _C_ESCAPES[code]
        if code == "x":
            j = self.i + 2
            while j < len(self.text) and self.text[j] in _HEX:
                j += 1
            if j > self.i + 2:
                value, self.i = int(self.text[self.i + 2:j], 16), j
                return self.codepoint(value)
        if code in "uU":
            n = 4 if code == "u" else 8
            digits = self.text[self.i + 2:self.i + 2 + n]
            if len(digits) == n and all(c in _HEX for c in digits):
                self.i += 2 + n
                return self.codepoint(int(digits, 16))
        if code == "u" and self.peek(2) == "{":
            j = self.i + 3
            while j < len(self.text) and self.text[j] in _HEX:
                j += 1
            if not 0 < j - self.i - 3 <= 6 or self.peek(j - self.i) != "}":
                raise self.error("invalid Unicode escape")
            value, self.i = int(self.text[self.i + 3:j], 16), j + 1
            return self.codepoint(value)
        if code == "c":
            letter = self.peek(2)
            if not (letter.isascii() and letter.isalpha()):
                raise self.error("invalid control-character escape")
            self.i += 3
            return ord(letter) % 32
        self.i += 2  # an unknown escape: the character itself
        return ord(code)

    def codepoint(self, value: int) -> int:
        if value > _MAX or 0xD800 <= value <= 0xDFFF:
            raise self.error(f"escape U+{value:X} is not a character")
        return value

    def char_class(self) -> str:
        self.i += 1
        if self.peek() == "]":
            raise self.error("an empty character class is not allowed")
        items = self.class_items()
        # xgrammar hands the class on as text, so a leading '^', escaped or not, negates it
        # (and `[^]` is any character).
        negated = items[0] == 0x5E
        if negated:
            items.pop(0)
            if not items:
                return "(?s:.)"
        return f"[{'^' if negated else ''}{_items(self.class_ranges(items))}]"

    def class_items(self) -> list[int | Ranges | None]:
        """A class's items up to its `]`: codepoints, class escapes' ranges, and raw '-'
        (None: a range's dash, or a literal at either end or after a class escape)."""
        items: list[int | Ranges | None] = []
        while self.peek() != "]":
            if not self.peek():
                raise self.error("unclosed '['")
            code = self.peek(1) if self.peek() == "\\" else ""
            if code and code.lower() in _CLASSES:
                self.i += 2
                escaped = _CLASSES[code.lower()]
                items.append(_complement(escaped) if code.isupper() else escaped)
            elif code:
                items.append(self.char_escape())
            else:
                items.append(None if self.peek() == "-" else ord(self.peek()))
                self.i += 1
        self.i += 1
        return items

    def class_ranges(self, items: list[int | Ranges | None]) -> Ranges:
        ranges: list[tuple[int, int]] = []
        k = 0
        while k < len(items):
            item = items[k]
            if isinstance(item, int) and k + 2 < len(items) and items[k + 1] is None:
                end = items[k + 2]
                if not isinstance(end, int):
                    raise self.error("a range cannot end in a class escape")
                if end < item:
                    raise self.error("a range out of order")
                ranges.append((item, end))
                k += 3
                continue
            if item is None:
                ranges.append((0x2D, 0x2D))
            elif isinstance(item, int):
                ranges.append((item, item))
            else:
                ranges.extend(item)
            k += 1
        return tuple(ranges)
